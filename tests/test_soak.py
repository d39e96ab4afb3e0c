"""bench/soak.py as a test: a short bounded soak against a REAL tritonserver and the OpenAI front in its own process.

The same tool as `make soak`, on the tiny decoupled CPU deployment (tests/ops_deploy.py), bounded by a request
count (and a generous duration). Asserted: no request failed, every counter of the metrics port equals the
client's count, the stubs' RSS grew by less than a generous bound in bytes, and no shared-memory region of the
server is left after it stops. Nothing is asserted on latency or wall-clock time.
"""

from __future__ import annotations

import bench_modules
import pytest

RSS_GROWTH_BOUND = 512 * 2**20  # bytes over the whole short run, all stubs together: a leak per request would pass it


def _soak_module():
    return bench_modules.load("soak")


@pytest.mark.server
def test_short_soak_has_no_errors_and_counters_equal_client_counts(tmp_path_factory):
    import ops_deploy

    soak = _soak_module()
    model_dir = ops_deploy.make_model(tmp_path_factory.mktemp("soak-model"))
    root = tmp_path_factory.mktemp("soak")
    _, _, recipe_path = ops_deploy.build(root, model_dir, "soak", triton={"decoupled": True})
    lines = []  # timeout_s (Triton calls and the front's): generous, the shared test machine may be loaded
    report = soak.serve_and_soak(
        str(recipe_path),
        str(root),
        duration_s=900,
        concurrency=8,
        max_requests=32,
        sample_s=2.0,
        timeout_s=600,
        max_new_tokens=(1, 4, 8),
        echo=lines.append,
    )
    assert report["requests"] == 32 and report["errors"] == 0, (report["error_samples"], lines)
    assert set(report["by_path"]) == set(soak.PATHS)  # both entry points, over Triton and over the front
    rows = report["counters"]["rows"]
    assert not report["counters"]["mismatches"], report["counters"]["mismatches"]
    checked = {r["metric"].split("{")[0] for r in rows}
    assert {
        "specdeploy_request_success_total",
        "specdeploy_request_failure_total",
        "specdeploy_prompt_tokens_total",
        "specdeploy_spec_decode_num_draft_tokens_total",
        "specdeploy_spec_decode_num_accepted_tokens_total",
        "specdeploy_spec_decode_num_drafts_total",
        "specdeploy_spec_decode_num_target_passes_total",
        "specdeploy_spec_decode_rounds_total",
        "specdeploy_num_requests_running",
        "nv_inference_request_success",
    } <= checked
    # the speculative entry point returns text, not ids (NVIDIA's BLS interface): output tokens have no exact client
    # count
    assert any("specdeploy_generation_tokens_total not compared" in note for note in report["counters"]["notes"])
    spec_ok = next(r for r in rows if r["metric"].startswith('nv_inference_request_success{model="tensorrt_llm_bls"'))
    control_ok = next(r for r in rows if r["metric"].startswith('nv_inference_request_success{model="ensemble"'))
    assert spec_ok["client"] == 16 and control_ok["client"] == 16  # the counts compared are the load that was sent
    assert report["stubs"] >= 6 and not report["stub_restarts"]
    processes = report["rss_by_process"]  # each stub instance by name, and the front
    assert "openai_front" in processes and "tensorrt_llm_0_0" in processes and len(processes) == report["stubs"] + 1
    assert all(0 < p["start"] <= p["max"] and p["end"] <= p["max"] for p in processes.values())
    assert sum(p["end"] for name, p in processes.items() if name != "openai_front") == report["stub_rss_bytes"]["end"]
    assert report["stub_rss_bytes"]["end"] - report["stub_rss_bytes"]["start"] < RSS_GROWTH_BOUND
    assert report["shm_regions_left"] == [] and report["server_live_at_end"]
    assert soak.failed(report) == []


def test_counter_comparison_names_a_mismatch():
    """compare_counters flags a counter the client disagrees with (the check is not vacuous)."""
    from specdeploy.core.metrics import reader

    soak = _soak_module()
    counts = soak.Counts()
    counts.ok["tensorrt_llm_bls"] = 3
    counts.rounds = [2, 2, 0]
    counts.drafted = counts.accepted = 4
    text = "\n".join(
        [
            'specdeploy_request_success_total{model="tensorrt_llm_bls",arm="speculative"} 2',
            'specdeploy_spec_decode_num_draft_tokens_total{model="tensorrt_llm_bls",arm="speculative"} 4',
        ]
    )
    result = soak.compare_counters(reader.parse(text), counts)
    wrong = {r["metric"] for r in result["mismatches"]}
    assert 'specdeploy_request_success_total{model="tensorrt_llm_bls",arm="speculative"}' in wrong
    assert 'specdeploy_spec_decode_num_draft_tokens_total{model="tensorrt_llm_bls",arm="speculative"}' not in wrong


def test_rss_by_process_names_the_instance_that_grows_and_a_restart():
    """Per process: start, end, peak and the last half's slope; an instance whose pid changed or vanished is a
    restart."""
    soak = _soak_module()
    mib = 2**20
    watch = [
        {
            "t_s": t,
            "stub_rss_by_instance": {"a_0_0": 100 * mib, "b_0_0": (100 + t) * mib},
            "stub_pids": {"a_0_0": 11, "b_0_0": 12 if t < 60 else 13},
            "front_rss_bytes": 50 * mib,
        }
        for t in (0, 30, 60, 90)
    ]
    watch[-1]["stub_rss_by_instance"]["a_0_0"] = 0
    del watch[-1]["stub_pids"]["a_0_0"], watch[-1]["stub_rss_by_instance"]["a_0_0"]
    rows = soak.rss_by_process(watch, half=45)
    assert rows["b_0_0"] == {
        "start": 100 * mib,
        "end": 190 * mib,
        "max": 190 * mib,
        "slope_last_half_bytes_per_min": 60 * mib,
    }
    assert rows["a_0_0"]["slope_last_half_bytes_per_min"] is None  # one sample in the last half
    assert rows["openai_front"]["slope_last_half_bytes_per_min"] == 0
    assert soak.stub_restarts(watch) == ["a_0_0", "b_0_0"]  # a went away, b changed its pid
    watch[-1]["stub_pids"]["a_0_0"] = 11
    for x in watch:
        x["stub_pids"]["b_0_0"] = 12
    assert soak.stub_restarts(watch) == []
