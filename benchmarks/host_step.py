"""Host work per engine step: what a step costs outside the model's forward (scheduling, block tables and
slot mappings, attention metadata, sampling, bookkeeping), at many long decodes.

256 text requests of 600 prompt tokens on the `tiny` model in fp32 (Qwen2-VL's, or `--family`'s; `--size 2b`
or `7b`: Qwen2-VL-2B or -7B at full depth, made on the device in bf16; `--size deep`: the tiny model's widths
at Qwen2-VL-2B's 28 layers, in fp32, where on a CPU a forward's time is mostly what a GPU's host spends
launching one), with a job's default engine settings
(prefix caching on), are prefilled, then timed over decode steps: per step, the wall time of `Engine.step`,
the model's forward (`forward_s`, logits included) and their difference, the host work. On a GPU the
forward runs while the host prepares nothing else, so the host work is what keeps the device waiting; on a
CPU it is time the cores do not compute.

`--profile` adds the ops and calls that took the most host time over the timed steps (torch's profiler;
the steps it watches are slower, so their times are not the table's). `--overlap` and `--cuda-graphs` time
the steps as the fast paths run them (`engine.overlap`, `engine.cuda_graphs`, the latter on CUDA only): an
overlapped step launches its forward without waiting for it and then waits for the step before's picks,
so its wall is what a job's decode steps take, its `forward` the launch, and `pack_and_launch` holds that
wait; set against the serial run's forward, it says whether the host or the device bounds the step.

`--transformers-loop-too` then times as many steps again with the engine's own loop of the language
model's layers (`layers/decoder_stack.py`) and as many with transformers' text model calling them, in four
alternated blocks each: the row's `loops` says what the engine's loop saves a step, in the same process.

    python benchmarks/host_step.py [--size tiny] [--family qwen2_vl] [--requests 256] [--prompt 600]
                                   [--steps 30] [--device cpu] [--profile] [--overlap] [--cuda-graphs]
                                   [--transformers-loop-too] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from workloads import sized_model, write_json

STEP_TOKENS = 4096  # engine.max_num_batched_tokens of the timed engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "deep", "2b", "7b"), default="tiny")
    parser.add_argument("--family", default="qwen2_vl", help="the tiny model's family (batchvl's names)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=600)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--profile", action="store_true", help="Also profile the timed steps' host work")
    parser.add_argument("--overlap", action="store_true", help="Overlapped steps (engine.overlap)")
    parser.add_argument("--cuda-graphs", action="store_true", help="Decode steps as CUDA graphs (CUDA only)")
    parser.add_argument(
        "--transformers-loop-too",
        action="store_true",
        help="Then time the steps with transformers' text model calling the layers",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from batchvl.config import EngineConfig
    from batchvl.engine.engine import Engine
    from batchvl.engine.model_runner import kv_bytes_per_block
    from batchvl.engine.request import EngineRequest
    from batchvl.engine.sampling.params import SamplingParams

    loaded = sized_model(args.size, args.device, args.family)
    # Enough new tokens that no request finishes before the timed steps end: the first prefilled decode
    # while the others prefill, a step per 4,096 tokens less the decodes that share it (at 1,024 requests
    # a quarter of each step; counting 4,096 prompt tokens a step ran the first requests out early).
    if args.requests >= STEP_TOKENS:
        raise SystemExit(f"--requests must be under {STEP_TOKENS}, the tokens of a step")
    prefill_steps = -(-args.requests * args.prompt // (STEP_TOKENS - args.requests))
    timed_steps = args.steps * (1 + 2 * args.transformers_loop_too)
    max_new_tokens = prefill_steps + timed_steps + 16 + 10 * args.profile
    tokens = args.prompt + max_new_tokens
    config = EngineConfig(
        max_num_seqs=args.requests,
        max_num_batched_tokens=STEP_TOKENS,
        kv_cache_mb=1 + args.requests * tokens * kv_bytes_per_block(loaded.adapter, 1) / 2**20,
        overlap=args.overlap,
        cuda_graphs=args.cuda_graphs,
    )
    engine = Engine(loaded.adapter, loaded.processor.tokenizer, config, loaded.eos_token_ids())
    generator = torch.Generator().manual_seed(0)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for i in range(args.requests):
        ids = torch.randint(100, 1000, (args.prompt,), generator=generator).tolist()
        engine.add_request(EngineRequest(ids, [], sampling, tag=i))
    while engine.scheduler.waiting or any(not r.is_prefill_done for r in engine.scheduler.running):
        engine.step()  # prefills, not timed
    phases = PhaseTimes(engine)
    timed = timed_steps_ms(engine, args.requests, args.steps, phases)
    phases.stop()
    if args.profile:
        profile = profiled_steps(engine, args.requests, steps=5)
    result = {
        "size": args.size,
        "family": args.family,
        "requests": args.requests,
        "context_tokens": args.prompt,
        "steps": args.steps,
        **timed,
        "host_ms_median_by_phase": phases.medians_ms(),
        "overlap": args.overlap,
        "cuda_graphs": engine.runner.decode_graphs is not None,  # as the engine ran, not as asked
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    print(
        f"{args.requests} decodes over {args.prompt}+ tokens: step {result['step_ms_median']} ms, model "
        f"forward {result['forward_ms_median']} ms, host work {result['host_ms_median']} ms "
        f"(medians of {args.steps})"
    )
    print(
        "host work by phase (medians, ms): " + ", ".join(f"{k} {v}" for k, v in phases.medians_ms().items())
    )
    if args.transformers_loop_too:
        result["loops"] = loops_compared(engine, loaded.adapter, args.requests, args.steps)
        for loop, medians in result["loops"].items():
            step, forward = medians["step_ms_median"], medians["forward_ms_median"]
            print(f"{loop} loop of layers: step {step} ms, forward {forward} ms")
    if args.profile:
        result["profile_per_step"] = profile
        for kind, rows in profile.items():
            print(f"{kind}, own host time per step:")
            for row in rows:
                print(f"{row['ms']:>9.3f} ms {row['calls']:>8.1f} calls  {row['name']}")
    write_json(args.json, result)


LOOP_ROUNDS = 4  # blocks of steps per loop, alternated: on a noisy machine a block's steps move together


def loops_compared(engine, adapter, requests: int, steps: int) -> dict:
    """`timed_steps_ms` of `steps` more decode steps with the engine's loop of layers and as many with
    transformers' text model running them, in alternated blocks (the first transformers')."""
    stack = adapter.decoder_stack
    times = {"engine": ([], []), "transformers": ([], [])}  # per loop: the steps' walls, their forwards
    for round_ in range(2 * LOOP_ROUNDS):
        loop = ("transformers", "engine")[round_ % 2]
        adapter.decoder_stack = stack if loop == "engine" else None
        for kept, timed in zip(times[loop], step_times(engine, requests, steps // LOOP_ROUNDS), strict=True):
            kept += timed
    adapter.decoder_stack = stack
    return {loop: medians_ms(walls, forwards) for loop, (walls, forwards) in times.items()}


def timed_steps_ms(engine, requests: int, steps: int, phases: PhaseTimes | None = None) -> dict:
    """Medians over `steps` decode steps of the step's wall, the model's forward and their difference (ms)."""
    return medians_ms(*step_times(engine, requests, steps, phases))


def medians_ms(walls, forwards) -> dict:
    host = [wall - forward for wall, forward in zip(walls, forwards, strict=True)]
    return {
        "step_ms_median": round(statistics.median(walls) * 1e3, 2),
        "forward_ms_median": round(statistics.median(forwards) * 1e3, 2),
        "host_ms_median": round(statistics.median(host) * 1e3, 2),
    }


def step_times(engine, requests: int, steps: int, phases: PhaseTimes | None = None) -> tuple[list, list]:
    """The walls and the forwards (seconds) of `steps` decode steps."""
    walls, forwards = [], []
    for _ in range(steps):
        forward_before = engine.runner.forward_s
        started = time.perf_counter()
        if engine.step() or len(engine.scheduler.running) != requests:
            raise SystemExit("a request finished or left before the timed steps ended")
        walls.append(time.perf_counter() - started)
        forwards.append(engine.runner.forward_s - forward_before)
        if phases is not None:
            phases.end_step(walls[-1] - forwards[-1])
    return walls, forwards


class PhaseTimes:
    """The host work of each timed step split by phase: the scheduler's plan (`schedule`), recording the
    computed tokens (`commit`), sampling and stop rules (`postprocess`), and the rest (`pack_and_launch`:
    the runner's step inputs and metadata, their upload, the forward's launch on a device that does not
    wait; the engine's own bookkeeping). Timed by wrapping the engine's methods on this instance."""

    # (an overlapped step has no `_postprocess`: its picks stay on the device, and `_stopped` applies the stop
    # rules to the step before's once they are read)
    TIMED = {
        "schedule": ("scheduler.schedule",),
        "commit": ("scheduler.commit",),
        "postprocess": ("_postprocess", "_stopped"),
    }

    def __init__(self, engine):
        self._restore = []
        self._spent = dict.fromkeys(self.TIMED, 0.0)
        self.steps: list[dict[str, float]] = []
        for phase, paths in self.TIMED.items():
            for path in paths:
                owner_path, _, name = path.rpartition(".")
                owner = engine if not owner_path else getattr(engine, owner_path)
                self._wrap(owner, name, phase)

    def _wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._spent[phase] += time.perf_counter() - started

        setattr(owner, name, timed)
        self._restore.append((owner, name))

    def end_step(self, host_s: float) -> None:
        step = dict(self._spent)
        step["pack_and_launch"] = host_s - sum(self._spent.values())
        self.steps.append(step)
        self._spent = dict.fromkeys(self.TIMED, 0.0)

    def stop(self) -> None:
        for owner, name in self._restore:
            delattr(owner, name)  # the class's method again

    def medians_ms(self) -> dict[str, float]:
        return {
            phase: round(statistics.median(step[phase] for step in self.steps) * 1e3, 2)
            for phase in self.steps[0]
        }


def profiled_steps(engine, requests: int, steps: int, rows: int = 15) -> dict:
    """Where `steps` more decode steps spend host time: torch ops by their own time (a device sync shows as
    a copy or `_local_scalar_dense` that waits), then Python functions by theirs (cProfile), each run over
    steps of its own."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    def run_steps():
        for _ in range(steps):
            if engine.step() or len(engine.scheduler.running) != requests:
                raise SystemExit("a request finished or left before the profiled steps ended")

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        run_steps()
    events = sorted(profiler.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
    ops = [
        {
            "name": e.key,
            "calls": round(e.count / steps, 1),
            "ms": round(e.self_cpu_time_total / 1e3 / steps, 3),
        }
        for e in events[:rows]
    ]
    python = cProfile.Profile()
    python.runcall(run_steps)
    stats = pstats.Stats(
        python
    ).stats  # (file, line, function) -> (calls, primitive, own, cumulative, callers)
    by_own = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:rows]
    functions = [
        {
            "name": f"{Path(file).name}:{line} {name}",
            "calls": round(calls / steps, 1),
            "ms": round(own * 1e3 / steps, 3),
        }
        for (file, line, name), (_, calls, own, _, _) in by_own
    ]
    return {"torch_ops": ops, "python_functions": functions}


if __name__ == "__main__":
    main()
