"""What the parity tests compare, at every generated position: the engine's tokens, its logits and the
positions it gave every token it fed, against transformers' `generate` (tokens and raw logits) and the
family's own position rule (`get_rope_index` for the Qwen families, 1-D positions for the others).

The references are computed on the CPU. With BATCHVL_TEST_DEVICE=cuda the engine runs on the GPU, where
fp32 kernels sum in other orders: there the logits may differ from the CPU reference by twice as much as
transformers' own `generate` on that GPU differs from it (`logits_tolerance`), and no more."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, replace
from unittest import mock

import torch

import batchvl.engine.model_runner as model_runner
from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest, EngineResult
from batchvl.engine.sampling.params import SamplingParams
from batchvl.preprocess.media import PreparedMedia
from tests.conftest import TEST_DEVICE, TEST_FAST_PATHS, tower_pixels
from tests.engine.fake_graphs import FakeGraphCapture

# Largest difference allowed between the engine's and generate's logits at a position, relative to the
# largest logit there (fp32; the two sum in different orders, so they are not bit-identical).
LOGITS_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Expected:
    tokens: list[int]
    logits: torch.Tensor  # (generated tokens, vocab): what each generated token was chosen from


def generate_reference(model, inputs: dict, max_new_tokens: int, **options) -> Expected:
    """`generate`, greedy unless `options` say otherwise, with the raw logits of every step."""
    out = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        **{"do_sample": False, **options},
    )
    prompt_length = inputs["input_ids"].shape[1]
    return Expected(out.sequences[0, prompt_length:].tolist(), torch.cat(out.logits).float().cpu())


_ON_TEST_DEVICE: dict[int, torch.nn.Module] = {}


def on_test_device(model):
    """A copy of a CPU reference model on the test device, made once per model."""
    if id(model) not in _ON_TEST_DEVICE:
        _ON_TEST_DEVICE[id(model)] = copy.deepcopy(model).to(TEST_DEVICE)
    return _ON_TEST_DEVICE[id(model)]


def device_gap(on_cpu: Expected, on_device: Expected) -> float:
    """The largest difference between two runs' finite logits, over the positions both computed from the
    same tokens (the first position whose chosen tokens differ is still compared; a sampled or near-tied
    run may go its own way after it)."""
    same = 0
    while same < min(len(on_cpu.tokens), len(on_device.tokens)) and (
        on_cpu.tokens[same] == on_device.tokens[same]
    ):
        same += 1
    positions = min(same + 1, len(on_cpu.logits), len(on_device.logits))
    one, other = on_cpu.logits[:positions], on_device.logits[:positions]
    finite = torch.isfinite(one) & torch.isfinite(other)
    return float((one - other)[finite].abs().max()) if finite.any() else 0.0


def logits_tolerance(model, inputs: dict, expected: Expected, reference_generate) -> float:
    """How far the engine's logits may be from `expected` (`reference_generate(model, inputs)` on the CPU):
    `LOGITS_TOLERANCE` of the largest finite logit, or on another test device twice the distance of
    `reference_generate` there from the CPU, if larger."""
    tolerance = LOGITS_TOLERANCE * float(expected.logits[torch.isfinite(expected.logits)].abs().max())
    if TEST_DEVICE == "cpu":
        return tolerance
    moved = {k: v.to(TEST_DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return max(tolerance, 2 * device_gap(expected, reference_generate(on_test_device(model), moved)))


def inputs_for(model, ids: list[int], media: list[PreparedMedia]) -> dict:
    """`generate`'s inputs for batchvl's own prompt ids and media tensors: for media the family's own
    processor cannot make here (video processors need torchvision)."""
    tensor_ids = torch.tensor([ids])
    if model.config.model_type in ("smolvlm", "internvl"):
        # every image's and video's frames (tiles), in prompt order: SmolVLM's as one sample's
        pixels = torch.from_numpy(tower_pixels(media))
        pixels = pixels[None] if model.config.model_type == "smolvlm" else pixels
        return {
            "input_ids": tensor_ids,
            "attention_mask": torch.ones_like(tensor_ids),
            "pixel_values": pixels,
        }
    token_types = torch.zeros_like(tensor_ids)
    token_types[tensor_ids == model.config.image_token_id] = 1
    token_types[tensor_ids == model.config.video_token_id] = 2
    inputs = {
        "input_ids": tensor_ids,
        "attention_mask": torch.ones_like(tensor_ids),
        "mm_token_type_ids": token_types,
    }
    for kind, pixels_key, grid_key in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        chosen = [m for m in media if m.kind == kind]
        if chosen:
            inputs[pixels_key] = torch.from_numpy(tower_pixels(chosen))
            inputs[grid_key] = torch.tensor([m.grid_thw for m in chosen])
    if model.config.model_type == "qwen2_5_vl":
        seconds = [m.seconds_per_grid_t for m in media if m.kind == "video"]
        inputs["second_per_grid_ts"] = torch.tensor(seconds)
    return inputs


def family_positions(model, token_ids: list[int], media: list[PreparedMedia]) -> torch.Tensor:
    """(axes, tokens) positions the model itself gives a sequence: its `get_rope_index` where it has one
    (multimodal rope), else 0, 1, 2, ..."""
    if not hasattr(model.model, "get_rope_index"):
        return torch.arange(len(token_ids))[None]
    inputs = inputs_for(model, token_ids, media)
    media_keys = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    positions, _ = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], **{k: inputs.get(k) for k in media_keys}
    )
    return positions[:, 0]


@dataclass
class Observed:
    result: EngineResult
    logits: torch.Tensor  # (generated tokens, vocab)
    # token index -> (axes,) position, for every token the engine computed (prompt tokens taken from the
    # prefix cache were computed by an earlier request, so they are not here)
    positions: dict[int, torch.Tensor]


def launches_fed_picks_in_flight(engine: Engine) -> list[bool]:
    """Per forward the engine launches, whether it was fed the picks of a step not yet read."""
    fed: list[bool] = []
    execute = engine.runner.execute

    def watched_execute(*args, **options):
        fed.append(options.get("picks_in_flight") is not None)
        return execute(*args, **options)

    engine.runner.execute = watched_execute
    return fed


class EngineProbe:
    """Runs an engine to the end, recording per request the logits of every sampled position and the
    positions of every token it fed (a preempted request's recompute must give the same again), and
    checking the engine's bookkeeping after every step and that each request is answered once."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._logits: dict[int, dict[int, torch.Tensor]] = {}
        self._positions: dict[int, dict[int, torch.Tensor]] = {}
        self.graphed_steps = 0  # the steps a decode graph ran, which read their positions from its buffer
        runner = engine.runner
        execute, adapter = runner.execute, runner.adapter
        replayed = self._watch_graphs(runner.decode_graphs)

        def recording_execute(chunks, embeddings, **options):
            fed = []  # the positions the model was given, (axes, rows) in the step's packed order

            def recording_forward(token_ids, positions, *args, **kwargs):
                fed.append(positions)
                return forward(token_ids, positions, *args, **kwargs)

            forward, own = adapter.forward, vars(adapter).get("forward")  # another probe's, if any
            adapter.forward = recording_forward
            try:
                out = execute(chunks, embeddings, **options)
            finally:
                if own is None:
                    del adapter.forward  # the class's method again
                else:
                    adapter.forward = own
            # a graph's replay calls no Python (on a GPU): its positions are those its static buffer held
            (positions,) = replayed or fed
            replayed.clear()
            positions = positions.cpu()  # the references are computed on the CPU
            row = 0
            for chunk in chunks:
                seen = self._positions.setdefault(chunk.request.request_id, {})
                for index in range(chunk.start, chunk.end):
                    column = positions[:, row].clone()
                    assert index not in seen or torch.equal(seen[index], column), "a recompute moved a token"
                    seen[index] = column
                    row += 1
            sampled = [chunk for chunk in chunks if chunk.samples_next_token]
            for chunk, row in zip(sampled, out.sampled, strict=True):
                request = chunk.request
                self._logits.setdefault(request.request_id, {})[request.num_output_tokens] = row.to(
                    "cpu", copy=True
                )
            return out

        runner.execute = recording_execute

    def _watch_graphs(self, graphs) -> list[torch.Tensor]:
        """A list that holds, after a step a decode graph ran, the positions the graph read."""
        replayed: list[torch.Tensor] = []
        if graphs is None:
            return replayed
        run = graphs.run

        def recording_run(chunks, *args):
            logits = run(chunks, *args)
            if logits is not None:
                # (the graph's rows: a step padded into a larger graph than its own bucket's lays out its
                # positions by that graph's)
                rows, axes = graphs.replayed_rows, chunks[0].request.positions.prompt.shape[0]
                replayed.append(graphs.buffers["positions"][: axes * rows].view(axes, rows).clone())
                self.graphed_steps += 1
            return logits

        graphs.run = recording_run
        return replayed

    def run(self, arrivals: dict[int, list[EngineRequest]] | None = None) -> dict:
        """tag -> Observed for every request added so far, and those of `arrivals` added before the step
        of their number (rejected ones: no logits, no positions)."""
        arrivals = dict(arrivals or {})
        ids: dict = {}
        results: dict = {}
        steps = 0
        while self.engine.num_unfinished or arrivals:
            for item in arrivals.pop(steps, []):
                self.engine.add_request(item)
            ids.update({request.request_id: request.tag for request in self.engine.scheduler.requests})
            for result in self.engine.step():
                assert result.tag not in results, f"{result.tag} answered twice"  # one result per request
                results[result.tag] = result
            self.engine.check_integrity()
            steps += 1
        observed = {tag: Observed(result, torch.empty(0), {}) for tag, result in results.items()}
        for request_id, tag in ids.items():
            self._drop_step_past_the_end(request_id, observed[tag].result)
            logits = self._logits.get(request_id, {})
            if logits:
                observed[tag].logits = torch.stack([logits[i] for i in sorted(logits)])
            observed[tag].positions = self._positions.get(request_id, {})
        return observed

    def _drop_step_past_the_end(self, request_id: int, result: EngineResult) -> None:
        """With `engine.overlap`, a request is run one step past its last token before its picks show its
        end: that step's position and logits are not its answer's, and there is at most that one."""
        if not self.engine.config.overlap:
            return
        logits, positions = self._logits.get(request_id, {}), self._positions.get(request_id, {})
        past = [index for index in logits if index >= len(result.output_token_ids)]
        if not past:
            return
        fed_last = result.num_prompt_tokens + len(result.output_token_ids) - 1  # its last token, fed
        assert past == [len(result.output_token_ids)], past
        assert max(positions) == fed_last, (max(positions), fed_last)
        del logits[past[0]], positions[fed_last]


@dataclass(frozen=True)
class Case:
    """One request and what transformers makes of it."""

    tag: object
    ids: list[int]  # the prompt
    media: list[PreparedMedia]
    expected: Expected
    positions: torch.Tensor  # the family's positions of the prompt and every generated token but the last
    tolerance: float  # the largest difference allowed between the engine's logits and `expected`'s


def make_case(model, tag, ids: list[int], media: list[PreparedMedia], inputs: dict, max_new_tokens: int):
    def reference_generate(model, inputs):
        return generate_reference(model, inputs, max_new_tokens)

    expected = reference_generate(model, inputs)
    positions = family_positions(model, ids + expected.tokens[:-1], media)
    return Case(
        tag, ids, media, expected, positions, logits_tolerance(model, inputs, expected, reference_generate)
    )


def with_fast_paths(loaded, limits: EngineConfig) -> Engine:
    """An engine with decode graphs and overlapped steps on: CUDA's graphs on a GPU, and on the CPU (where
    the engine captures none) `FakeGraphCapture`'s, which replay the step over the same static buffers."""
    limits = replace(limits, cuda_graphs=True, overlap=True)
    if TEST_DEVICE == "cpu":
        capture = mock.patch.object(model_runner, "graph_capture", lambda device: FakeGraphCapture())
    else:
        capture = contextlib.nullcontext()
    with capture:
        return Engine(loaded.adapter, loaded.processor.tokenizer, limits, loaded.eos_token_ids())


def run_cases(
    loaded, cases: list[Case], limits, sampling: SamplingParams, fast_paths: bool = TEST_FAST_PATHS
) -> tuple[Engine, dict]:
    """An engine over every case at once, run to the end; (engine, tag -> Observed). `fast_paths`: with
    decode graphs and overlapped steps (see `with_fast_paths`)."""
    if fast_paths:
        engine = with_fast_paths(loaded, limits)
    else:
        eager = replace(limits, cuda_graphs=False, overlap=False)  # (`auto` turns them on on a GPU)
        engine = Engine(loaded.adapter, loaded.processor.tokenizer, eager, loaded.eos_token_ids())
    probe = EngineProbe(engine)
    for case in cases:
        engine.add_request(EngineRequest(case.ids, case.media, sampling, case.tag))
    return engine, probe.run()


def assert_matches_reference(observed: Observed, case: Case) -> None:
    """Same tokens, logits within `LOGITS_TOLERANCE`, and the family's positions for every fed token."""
    expected = case.expected
    assert observed.result.error is None, (case.tag, observed.result.error)
    assert observed.result.output_token_ids == expected.tokens, case.tag
    torch.testing.assert_close(
        observed.logits, expected.logits, rtol=0, atol=case.tolerance, msg=lambda text: f"{case.tag}: {text}"
    )
    fed = sorted(observed.positions)  # the prompt after its cached prefix, then the generated tokens
    assert fed == list(range(fed[0], case.positions.shape[1])), case.tag
    got = torch.stack([observed.positions[i] for i in fed], dim=1)
    assert torch.equal(got, case.positions[:, fed[0] :]), case.tag


def video_cases(reference, processor, clip: PreparedMedia, image: PreparedMedia, max_new_tokens: int) -> list:
    """The video parity tests' cases: a video alone, and an image with the video after it, one prompt."""
    from batchvl.preprocess.prompts import PromptRenderer

    renderer = PromptRenderer(processor)
    cases = []
    for name, media in {"video": [clip], "image+video": [image, clip]}.items():
        ids = renderer.token_ids(
            renderer.render("What happens in this clip?", [m.kind for m in media]), media
        )
        cases.append(
            make_case(reference, name, ids, media, inputs_for(reference, ids, media), max_new_tokens)
        )
    return cases
