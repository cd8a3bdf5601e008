"""The launch settings a GPU window's kernel benchmarks found faster than the defaults
(benchmarks/launch_settings.py): chosen per set of cases timed alike, only beyond the noise margin; checked
in one line before a job runs with them; and set on the kernels' modules for the job alone."""

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def settings(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("launch_settings")


def elementwise_report() -> dict:
    """`fused_elementwise.py`'s rows: every op with the defaults at two row counts, the elementwise ops and
    the norms under their own launch settings at the larger."""
    defaults = {
        "silu_and_mul": 100.0,
        "quick_gelu_bias": 200.0,
        "rms_norm_residual": 50.0,
        "layer_norm": 60.0,
    }
    rows = [{"op": op, "rows": 32768, "fused_us": us} for op, us in defaults.items()]
    rows += [{"op": op, "rows": 256, "fused_us": 1.0} for op in defaults]
    swept = {
        (("BLOCK_COLUMNS", 2048), ("ELEMENTWISE_WARPS", 4)): {"silu_and_mul": 90.0, "quick_gelu_bias": 190.0},
        (("BLOCK_COLUMNS", 4096), ("ELEMENTWISE_WARPS", 8)): {"silu_and_mul": 95.0, "quick_gelu_bias": 180.0},
        (("NORM_WARPS", 8),): {"rms_norm_residual": 49.0, "layer_norm": 59.0},  # 2% faster: noise
        (("NORM_WARPS", 16),): {"rms_norm_residual": 60.0, "layer_norm": 70.0},
    }
    for launch, times in swept.items():
        rows += [
            {"op": op, "rows": 32768, "launch": dict(launch), "fused_us": us} for op, us in times.items()
        ]
    return {"results": rows}


def test_the_fastest_settings_of_each_group_of_ops_are_chosen_beyond_the_noise(settings):
    chosen = settings.fastest_launches(
        elementwise_report(), settings.ELEMENTWISE_CASE, settings.ELEMENTWISE_TIME
    )
    # 275 us against the defaults' 300 over the two elementwise ops; the norms' best is within 3%
    assert chosen == {"BLOCK_COLUMNS": 4096, "ELEMENTWISE_WARPS": 8}


def test_the_norms_settings_are_chosen_apart_from_the_elementwise_ones(settings):
    report = elementwise_report()
    for row in report["results"]:
        if row.get("launch") == {"NORM_WARPS": 8}:
            row["fused_us"] -= 5.0  # now 98 us against 110: 11% faster
    chosen = settings.fastest_launches(report, settings.ELEMENTWISE_CASE, settings.ELEMENTWISE_TIME)
    assert chosen == {"BLOCK_COLUMNS": 4096, "ELEMENTWISE_WARPS": 8, "NORM_WARPS": 8}


def test_one_decode_kernel_takes_the_fastest_of_its_alternative_settings(settings):
    cases = [("2b", 256, 600), ("2b", 1024, 600)]
    rows = [dict(zip(settings.DECODE_CASE, case, strict=True), grouped_us=100.0) for case in cases]
    rows.append({"shape": "7b", "sequences": 8, "keys": 16384, "grouped_us": 50.0})  # not swept
    for launch, us in (
        ({"BLOCK_KEYS": 128}, 90.0),
        ({"DECODE_WARPS": 8}, 95.0),
        ({"DECODE_STAGES": 1}, 99.0),
    ):
        rows += [
            dict(zip(settings.DECODE_CASE, case, strict=True), launch=launch, grouped_us=us) for case in cases
        ]
    # a setting timed on a case the defaults were not is no comparison
    rows.append({"shape": "2b", "sequences": 7, "keys": 1, "launch": {"BLOCK_KEYS": 32}, "grouped_us": 1.0})
    chosen = settings.fastest_launches({"results": rows}, settings.DECODE_CASE, settings.DECODE_TIME)
    assert chosen == {"BLOCK_KEYS": 128}
    slower = [dict(row, grouped_us=101.0) if "launch" in row else row for row in rows[:-1]]
    assert settings.fastest_launches({"results": slower}, settings.DECODE_CASE, settings.DECODE_TIME) == {}


def vision_rows(sdpa_ms: float) -> dict:
    rows = [
        {"patches": 32768, "fused_kernels": False, "vision_attention": "flash_varlen", "wall_ms": 200.0},
        {"patches": 32768, "fused_kernels": True, "vision_attention": "flash_varlen", "wall_ms": 100.0},
        {"patches": 32768, "fused_kernels": True, "vision_attention": "sdpa", "wall_ms": sdpa_ms},
        # a replayed graph's call, which SDPA's eager one is not set against
        {
            "patches": 32768,
            "fused_kernels": True,
            "vision_attention": "flash_varlen",
            "vision_graphs": True,
            "wall_ms": 60.0,
        },
        {"patches": 4096, "fused_kernels": True, "vision_attention": "flash_varlen", "wall_ms": 40.0},
        {"patches": 4096, "fused_kernels": True, "vision_attention": "sdpa", "wall_ms": 20.0},
    ]
    return {"rows": rows}


def test_the_towers_attention_is_chosen_at_the_largest_call_with_the_fused_kernels(settings):
    assert settings.fastest_vision_attention(vision_rows(90.0)) == "sdpa"
    assert settings.fastest_vision_attention(vision_rows(98.0)) is None  # within the noise
    assert settings.fastest_vision_attention(vision_rows(150.0)) is None  # (faster than the unfused call)
    assert settings.fastest_vision_attention({"rows": []}) is None


def test_the_towers_attention_is_chosen_on_the_jobs_image_mix_where_the_call_was_timed_on_it(settings):
    def mixed(varlen_ms: float, sdpa_ms: float) -> dict:
        rows = vision_rows(90.0)["rows"]  # SDPA faster on the 448x448 calls
        for attention, wall in (("flash_varlen", varlen_ms), ("sdpa", sdpa_ms)):
            row = {"patches": 31744, "fused_kernels": True, "vision_attention": attention, "wall_ms": wall}
            rows.append({**row, "image_mix": "job"})
        return {"rows": rows}

    assert settings.fastest_vision_attention(mixed(100.0, 120.0)) is None  # slower on the job's mix
    assert settings.fastest_vision_attention(mixed(120.0, 100.0)) == "sdpa"


@pytest.mark.parametrize(
    "given,message",
    [
        ([1], "--launch-settings takes a JSON object of modules"),
        ({"triton_attention": {}}, "--launch-settings: no kernels' module triton_attention; the modules are"),
        ({"triton_elementwise": 4}, "--launch-settings: triton_elementwise takes an object of settings"),
        ({"triton_elementwise": {"BLOCK_KEYS": 4}}, "triton_elementwise has no setting BLOCK_KEYS; it has"),
        ({"triton_grouped_decode": {"BLOCK_KEYS": 96}}, "BLOCK_KEYS is 96; give a power of two"),
        ({"triton_grouped_decode": {"DECODE_STAGES": 0}}, "DECODE_STAGES is 0; give a whole number of 1"),
        ({"triton_grouped_decode": {"DECODE_WARPS": True}}, "DECODE_WARPS is True; give a whole number"),
    ],
)
def test_settings_a_kernel_cannot_take_are_refused_in_one_line(settings, given, message):
    problem = settings.problem(given)
    assert message in problem and "\n" not in problem


def test_good_settings_are_taken(settings):
    assert settings.problem({"triton_grouped_decode": {"DECODE_STAGES": 3, "BLOCK_KEYS": 128}}) is None
    assert settings.problem({}) is None


def test_settings_are_the_kernels_inside_the_block_and_their_defaults_after_it(settings):
    from batchvl.layers import triton_elementwise, triton_grouped_decode

    defaults = (triton_grouped_decode.BLOCK_KEYS, triton_elementwise.NORM_WARPS)
    tuned = {"triton_grouped_decode": {"BLOCK_KEYS": 128}, "triton_elementwise": {"NORM_WARPS": 8}}
    with pytest.raises(RuntimeError), settings.applied(tuned):
        assert (triton_grouped_decode.BLOCK_KEYS, triton_elementwise.NORM_WARPS) == (128, 8)
        raise RuntimeError("the job failed")
    after = (triton_grouped_decode.BLOCK_KEYS, triton_elementwise.NORM_WARPS)
    assert after == defaults


def test_each_kernels_module_takes_what_its_own_benchmark_found(settings):
    chosen = settings.fastest_of({"fused_elementwise": elementwise_report(), "decode_attention": None})
    assert chosen == {"triton_elementwise": {"BLOCK_COLUMNS": 4096, "ELEMENTWISE_WARPS": 8}}
    decode = [{"shape": "2b", "sequences": 256, "keys": 600, "grouped_us": 100.0}]
    decode.append({**decode[0], "launch": {"DECODE_WARPS": 2}, "grouped_us": 90.0})
    chosen = settings.fastest_of({"decode_attention": {"results": decode}, "fused_elementwise": None})
    assert chosen == {"triton_grouped_decode": {"DECODE_WARPS": 2}}
