"""Latency models: the fit recovers known coefficients, JSON round trip, roofline shape, the
spec parser; and `pagedkv profile` fits on real runner timings."""

from __future__ import annotations

import json
import random

import pytest

from pagedkv.sim.latency import (
    FittedLatency,
    Hardware,
    LinearLatency,
    ModelShape,
    RooflineLatency,
    StepShape,
    make_latency_model,
)
from pagedkv.sim.setup import load_model_config


def _shapes(n: int = 60) -> list[StepShape]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        p, d = rng.choice((0, 16, 256, 1024)), rng.choice((0, 1, 8, 32))
        c = rng.choice((64, 512, 2048))
        out.append(StepShape(prefill_tokens=p, prefill_seqs=1 if p else 0,
                             prefill_attention=p * (p + 1) / 2, decode_seqs=d,
                             decode_context=d * c))
    return out


def test_fit_recovers_coefficients_and_round_trips(tmp_path):
    truth = FittedLatency({"intercept": 2e-3, "prefill_tokens": 5e-5, "prefill_attention": 1e-9,
                           "decode_seqs": 3e-4, "decode_context": 2e-8})
    shapes = _shapes()
    times = [truth.step_time(s) for s in shapes]
    fitted = FittedLatency.fit(shapes, times)
    for name, value in truth.coefficients.items():
        assert fitted.coefficients[name] == pytest.approx(value, rel=1e-6, abs=1e-12), name
    assert fitted.meta["max_rel_error"] < 1e-6
    path = tmp_path / "lat.json"
    fitted.save(path)
    loaded = make_latency_model(str(path))
    assert isinstance(loaded, FittedLatency)
    assert [loaded.step_time(s) for s in shapes] == pytest.approx(times, rel=1e-9)


def test_calibrate_recovers_the_serving_costs_around_a_profile(tmp_path, capsys):
    from pagedkv.cli import main
    from pagedkv.sim.latency.calibrate import calibrate

    profiled = FittedLatency({"intercept": 2e-3, "prefill_tokens": 5e-5, "decode_seqs": 3e-4,
                              "decode_context": 2e-8}, {"clock": "cpu"})
    shapes = _shapes()
    # the server: 2.5x the profiled work, 4 ms a step and 0.2 ms a request around it
    times = [2.5 * profiled.step_time(s) + 4e-3 + 2e-4 * (s.decode_seqs + s.prefill_seqs)
             for s in shapes]
    served = calibrate(profiled, shapes, times)
    cal = served.meta["calibration"]
    assert cal["share"] == pytest.approx(2.5) and cal["per_step"] == pytest.approx(4e-3)
    assert cal["per_request"] == pytest.approx(2e-4) and cal["total_ratio"] == pytest.approx(1)
    assert [served.step_time(s) for s in shapes] == pytest.approx(times)
    assert served.meta["clock"] == "cpu"  # the profile's meta is kept
    # a server faster than its profile by a fixed amount: no negative gap, the share absorbs it
    faster = calibrate(profiled, shapes, [profiled.step_time(s) * 0.9 for s in shapes])
    # (no exact float compare: the least-squares fit leaves ~1e-18 on some CPUs)
    assert 0.0 <= faster.meta["calibration"]["per_step"] < 1e-12
    assert faster.meta["calibration"]["share"] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="at least 3"):
        calibrate(profiled, shapes[:2], times[:2])
    # the CLI: --fit-from STEP_LOG --calibrate PROFILE
    profile_path, log, out = tmp_path / "p.json", tmp_path / "steps.jsonl", tmp_path / "c.json"
    profiled.save(profile_path)
    log.write_text("".join(json.dumps({**s.__dict__, "seconds": t, "cpu_seconds": t,
                                       "own_seconds": t, "chained": True}) + "\n"
                           for s, t in zip(shapes, times, strict=True)))
    assert main(["profile", "--fit-from", str(log), "--calibrate", str(profile_path),
                 "--out", str(out)]) == 0
    assert "2.500x the profile + 4.000 ms a step + 0.2000 ms a request" in \
        capsys.readouterr().out
    assert FittedLatency.load(out).step_time(shapes[5]) == pytest.approx(times[5])


def test_relative_fit_keeps_short_steps_right_on_a_grid():
    # A cost the features cannot express exactly (prefill superlinear beyond attention): the
    # default weighting lets the few long steps pull the short ones off; relative weighting
    # (the profile's grid) bounds every step's relative error.
    shapes = _shapes()
    times = [3e-3 + 2e-4 * s.decode_seqs + 1e-4 * s.prefill_tokens ** 1.15 for s in shapes]

    def worst(fitted):
        return max(abs(fitted.step_time(s) - t) / t for s, t in zip(shapes, times, strict=True))

    default, relative = FittedLatency.fit(shapes, times), \
        FittedLatency.fit(shapes, times, relative=True)
    assert worst(relative) < worst(default)
    assert relative.meta["max_rel_error"] == pytest.approx(worst(relative))


def test_absolute_fit_keeps_the_total_of_steps_slowed_at_random():
    """Decode steps of one size whose wall time is sometimes several times longer (another
    process took the core): weights 1 / sqrt(time) put the slow ones low and the fit's total
    comes out short; weighing them alike keeps the total (what TPOT averages)."""
    shapes = [StepShape(decode_seqs=1 + i % 4, decode_context=400 * (1 + i % 4) + i)
              for i in range(200)]
    rng = random.Random(2)
    times = [(4e-3 + 2e-3 * s.decode_seqs) * (5.0 if rng.random() < 0.2 else 1.0)
             for s in shapes]
    short = FittedLatency.fit(shapes, times)
    kept = FittedLatency.fit(shapes, times, absolute=True)
    assert short.meta["total_ratio"] < 0.9
    assert kept.meta["total_ratio"] == pytest.approx(1.0, abs=0.01)
    with pytest.raises(ValueError, match="relative or absolute"):
        FittedLatency.fit(shapes, times, relative=True, absolute=True)


def test_fit_keeps_coefficients_non_negative():
    shapes = _shapes()
    rng = random.Random(1)
    times = [1e-3 + 4e-5 * s.prefill_tokens + 1e-4 * s.decode_seqs * rng.random()
             for s in shapes]
    fitted = FittedLatency.fit(shapes, times)
    assert all(v >= 0 for v in fitted.coefficients.values())
    with pytest.raises(ValueError, match="samples"):
        FittedLatency.fit(shapes[:3], times[:3])


def test_bad_latency_specs(tmp_path):
    with pytest.raises(ValueError, match="unknown latency model"):
        make_latency_model("warp-drive")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "other"}))
    with pytest.raises(ValueError, match="not a fitted model"):
        make_latency_model(str(bad))
    with pytest.raises(ValueError, match="unknown latency coefficients"):
        FittedLatency({"warp": 1.0})
    with pytest.raises(ValueError, match="needs the model's config"):
        make_latency_model("roofline:h100")
    with pytest.raises(ValueError, match="unknown hardware"):
        make_latency_model("roofline:tpu9", load_model_config("llama-3-8b"))


def test_a_hardware_file_sizes_the_cache_and_bad_ones_are_named(tmp_path):
    import argparse

    from pagedkv.commands.simulate import add_parser
    from pagedkv.sim.latency.roofline import load_hardware
    from pagedkv.sim.setup import build_sim_config

    def blocks(hardware: str) -> int:
        flags = add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
            ["trace.jsonl", "--model", "llama-3-8b", "--hardware", hardware])
        return build_sim_config(flags)[0].num_blocks

    small, big = tmp_path / "small.json", tmp_path / "big.json"
    for path, gib in ((small, 40), (big, 80)):
        path.write_text(json.dumps({"flops": 1e15, "memory_bandwidth": 3e12,
                                    "memory_bytes": gib * 2.0 ** 30}))  # a float, as JSON has it
    # the file's memory sizes the cache (it was ignored: "gives no memory size")
    assert blocks(str(big)) == blocks("h100") > blocks(str(small)) > 0
    assert load_hardware(str(big)).memory_bytes == 80 << 30
    for text, says in (('{"flops": 1e15, "bandwidth": 3e12}', "unknown fields .*bandwidth"),
                       ("[1, 2]", "unknown fields"), ("{", "not JSON"),
                       ('{"flops": 1e15}', "memory_bandwidth"),
                       ('{"flops": 1e15, "memory_bandwidth": 1e12, "memory_bytes": -1}',
                        "memory_bytes must be >= 0")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=says):
            load_hardware(str(bad))


def test_roofline_is_memory_bound_for_decode_and_compute_bound_for_prefill():
    model = ModelShape.from_config(load_model_config("llama-3-8b"))
    assert 7e9 < model.num_params < 9e9
    hw = Hardware("t", flops=1e15, memory_bandwidth=3e12, mfu=1.0, mbu=1.0, step_overhead=0.0)
    roof = RooflineLatency(model, hw)
    decode = roof.step_time(StepShape(decode_seqs=1, decode_context=100))
    assert decode == pytest.approx((model.weight_bytes + 101 * model.kv_bytes_per_token)
                                   / 3e12, rel=1e-3)
    # Decode: batching is nearly free until compute catches up; prefill grows linearly.
    assert roof.step_time(StepShape(decode_seqs=8, decode_context=800)) < 1.1 * decode
    p1 = roof.step_time(StepShape(prefill_tokens=4096, prefill_attention=4096 * 2048))
    p2 = roof.step_time(StepShape(prefill_tokens=8192, prefill_attention=8192 * 4096))
    assert p2 > 2 * p1
    h100 = make_latency_model("roofline:h100", load_model_config("llama-3-8b"))
    assert 5e-3 < h100.step_time(StepShape(decode_seqs=1, decode_context=100)) < 2e-2
    assert LinearLatency().step_time(StepShape()) == pytest.approx(2e-3)


def test_profile_fits_the_real_runner(tiny_llama):
    from pagedkv.engine.args import EngineArgs
    from pagedkv.sim.profiling import profile_model

    args = EngineArgs(model=str(tiny_llama), device="cpu", num_gpu_blocks_override=600,
                      cpu_kernels="off")
    grid = dict(prefill_tokens=(0, 32, 256), decode_seqs=(0, 1, 8), context=(32, 256))
    fitted = profile_model(args, grid, repeats=1)
    assert fitted.meta["samples"] == 14  # every shape but the empty one; all fit the cache
    assert all(v >= 0 for v in fitted.coefficients.values())
    points = fitted.meta["points"]
    assert all(p["wall_seconds"] > 0 and p["cpu_seconds"] > 0 for p in points)
    assert fitted.meta["clock"] == "wall" and fitted.meta["wall_over_cpu"] > 0
    host = fitted.meta["host_overhead"]  # the engine's work around the runner, in the model
    assert host["per_step"] >= 0 and host["per_request"] >= 0
    assert fitted.coefficients["intercept"] >= host["per_step"]
    assert fitted.coefficients["decode_seqs"] >= host["per_request"]
    big = max(points, key=lambda p: p["prefill_tokens"] + p["decode_seqs"])
    shape = StepShape(**{k: v for k, v in big.items() if not k.endswith("seconds")})
    assert fitted.step_time(shape) > 0
    with pytest.raises(ValueError, match="'gpu'"):
        profile_model(args, grid, clock="gpu")


def test_engine_step_log_and_fit_from(tiny_llama, tmp_path, capsys):
    """`EngineArgs.step_log` writes one line per step that computed something, with the shape
    the simulator sees; `pagedkv profile --fit-from` fits a model to it."""
    from pagedkv.cli import main
    from pagedkv.engine.args import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.step_log import read_step_log
    from pagedkv.sched.sampling_params import SamplingParams

    log = tmp_path / "steps.jsonl"
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), device="cpu", cpu_kernels="off",
                                  num_gpu_blocks_override=64, max_num_batched_tokens=32,
                                  step_log=str(log)))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.add_request("a", list(range(10, 50)), params)  # 40 tokens: chunked 32 + 8
    engine.add_request("b", list(range(60, 70)), params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()
    engine.shutdown()
    shapes, times = read_step_log(log)
    _, cpu = read_step_log(log, "cpu")
    assert sum(s.prefill_tokens for s in shapes) == 50
    assert sum(s.decode_seqs for s in shapes) == 2 * 4  # 5 tokens: the first from the prefill
    assert shapes[0] == StepShape(prefill_tokens=32, prefill_seqs=1,
                                  prefill_attention=32 * 33 / 2)
    # a's second chunk (8 tokens at position 32) attends to the 32 cached before it
    assert sum(s.prefill_past for s in shapes) == 8 * 32
    assert all(t > 0 for t in times) and all(c >= 0 for c in cpu)
    _, own = read_step_log(log, "own")  # the step alone: the host gap after it is the rest
    assert all(0 < o <= t for o, t in zip(own, times, strict=True))
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["chained"] for r in rows] == [True] * (len(rows) - 1) + [False]
    with pytest.raises(ValueError, match="clock"):
        read_step_log(log, "gpu")
    old = tmp_path / "old.jsonl"  # a log from before prefill_past: read as 0
    old.write_text(json.dumps({k: v for k, v in rows[0].items() if k != "prefill_past"}) + "\n")
    assert read_step_log(old)[0][0].prefill_past == 0 == rows[0]["prefill_past"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prefill_tokens": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_step_log(bad)
    out = tmp_path / "fit.json"
    # Pad to enough samples for the fit: the same log three times.
    log.write_text(log.read_text() * 3)
    assert main(["profile", "--fit-from", str(log), "--out", str(out)]) == 0
    fitted = FittedLatency.load(out)
    assert fitted.meta["samples"] == 3 * len(rows) and fitted.meta["step_log"] == str(log)
    assert "steps, mean error" in capsys.readouterr().out
    assert main(["profile", str(tiny_llama), "--fit-from", str(log)]) != 0
    assert "not both" in capsys.readouterr().err
    # With the same run's request log, the frontend's delays are fitted too (medians).
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        '{"submitted": 0.002, "ttft": 0.05, "engine_first_token": 0.049, "e2e": 0.2, '
        '"engine_last_token": 0.196}\n'
        '{"submitted": 0.004, "ttft": 0.07, "engine_first_token": 0.067, "e2e": 0.3, '
        '"engine_last_token": 0.294}\n')
    assert main(["profile", "--fit-from", str(log), "--request-log", str(requests),
                 "--out", str(out)]) == 0
    assert "frontend delays: admit 3.00 ms, output 2.00 ms, finish 5.00 ms" in \
        capsys.readouterr().out
    delays = FittedLatency.load(out).frontend
    assert delays.admit == pytest.approx(0.003) and delays.output == pytest.approx(0.002)
    assert delays.finish == pytest.approx(0.005)
    assert main(["profile", str(tiny_llama), "--request-log", str(requests)]) != 0
    assert "--request-log goes with --fit-from" in capsys.readouterr().err


def test_step_shape_counts_the_blocks_saved_to_the_store():
    from pagedkv.sched.output import SchedulerOutput
    from pagedkv.store.connector import StoreConnectorMetadata

    meta = StoreConnectorMetadata(saves=[(3, None), (4, None)])
    shape = StepShape.of(SchedulerOutput(kv_connector_metadata=meta))
    assert shape.saved_blocks == 2 == meta.num_saves
    assert StepShape.of(SchedulerOutput()).saved_blocks == 0
    fitted = FittedLatency({"intercept": 1e-3, "saved_blocks": 1e-4})
    assert fitted.step_time(shape) == pytest.approx(1.2e-3)


@pytest.mark.parametrize("cache_dtype", ["auto", "int8", "fp8", "fp8_e5m2"])
def test_the_simulated_cache_of_each_format_has_the_planners_blocks_and_bytes(cache_dtype):
    """`pagedkv simulate --kv-cache-dtype F` sizes its cache as `pagedkv plan
    --kv-cache-dtype F` on the same memory (int8's scales counted), its store tiers and
    roofline read that format's bytes, and an unknown format is refused by name."""
    import argparse

    from pagedkv.commands.plan import add_parser as add_plan
    from pagedkv.commands.plan import make_plan
    from pagedkv.commands.simulate import add_parser
    from pagedkv.sim.setup import build_sim_config

    sim_flags = add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
        ["trace.jsonl", "--model", "llama-3-8b", "--hardware", "h100",
         "--kv-cache-dtype", cache_dtype])
    config, model_config, _ = build_sim_config(sim_flags)
    plan_flags = add_plan(argparse.ArgumentParser().add_subparsers()).parse_args(
        ["--config", "llama-3-8b", "--memory", "80GiB", "--kv-cache-dtype", cache_dtype])
    plan = make_plan(plan_flags)[0]
    assert config.num_blocks == plan.num_blocks
    assert config.block_bytes == plan.bytes_per_block
    roof = make_latency_model("roofline:h100", model_config, kv_cache_dtype=cache_dtype)
    assert roof.model.kv_bytes_per_token * 16 == plan.bytes_per_block
    with pytest.raises(SystemExit):
        add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
            ["trace.jsonl", "--kv-cache-dtype", "int4"])
