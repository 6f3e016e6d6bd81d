"""The traced step's summary (``vlmshard.train.trace``): a hand-written trace's figures counted by
hand, and a real profiler run writes the trace with its summary beside it; the host sampler
finds a thread's time where the thread spent it."""

from __future__ import annotations

import json
import time

import torch

from vlmshard.train.trace import (
    HostSampler,
    annotated,
    by_layer,
    host_while_idle,
    kernel_class,
    sampled_step,
    summarize,
    traced_step,
)


def test_summary_of_a_hand_written_trace(tmp_path):
    """Kernels at [0, 10), [5, 20) and [30, 40) µs: busy 30 µs (the overlap counted once) over a
    span of 40; two GEMMs, one flash kernel, one memcpy; a CPU op and a stream sync."""
    events = [
        {"cat": "kernel", "name": "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "ts": 0, "dur": 10},
        {"cat": "kernel", "name": "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "ts": 5, "dur": 15},
        {"cat": "kernel", "name": "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>",
         "ts": 30, "dur": 8},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 38, "dur": 2},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 41, "dur": 4},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1, "dur": 1},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = summarize(str(path), top=2)
    assert summary["device_busy_s"] == 30e-6 and summary["device_span_s"] == 40e-6
    assert summary["by_class"] == {"gemm": 25e-6, "attention": 8e-6, "copy": 2e-6}
    assert [(k["class"], k["calls"], k["s"]) for k in summary["top_kernels"]] == [
        ("gemm", 2, 25e-6), ("attention", 1, 8e-6)]
    assert summary["host_syncs"] == {"cudaStreamSynchronize": {"calls": 1, "s": 4e-6}}
    # no layer ranges, no launches: nothing is charged to a part
    assert summary["by_layer"] == {"unattributed": summary["by_class"]}


def test_kernel_classes_of_names_seen_on_an_h200():
    assert kernel_class("void at::native::vectorized_elementwise_kernel<4, "
                        "at::native::GeluCUDAKernelImpl>") == "elementwise"
    assert kernel_class("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel"
                        "<c10::BFloat16, float, true>") == "norm"
    assert kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_class("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "reduction"
    assert kernel_class("some_new_kernel") == "other"


def test_traced_step_writes_the_trace_and_its_summary(tmp_path):
    with traced_step(str(tmp_path), rank=0, step=1, cuda=False, on=True):
        torch.ones(64, 64) @ torch.ones(64, 64)
    trace = json.loads((tmp_path / "trace-rank0-step1.json").read_text())
    assert any(e.get("name") == "aten::matmul" for e in trace["traceEvents"])
    summary = json.loads((tmp_path / "trace-rank0-step1-summary.json").read_text())
    # on CPU the trace holds no device work
    assert summary["device_span_s"] == 0 and summary["top_kernels"] == []
    with traced_step(str(tmp_path / "off"), rank=0, step=1, cuda=False, on=False):
        pass
    assert not (tmp_path / "off").exists()


def test_idle_device_time_goes_to_what_the_launching_thread_ran():
    """Gaps of 30 µs ([10, 40)), 2 µs (under the 10 µs bound: left out) and 40 µs ([60, 100)),
    each charged, by hand, to the outermost ops of the thread that launched the kernel ending it
    (thread 1, then the autograd thread 2; thread 1's op in the second gap is not charged), the
    rest of the gap to ``(python)``, named by the layer whose range the launch was made in
    (thread 1's, in ``vit_embed``'s)."""
    import pytest

    def kernel(ts, dur, correlation):
        return {"cat": "kernel", "name": "nvjet_tst", "ts": ts, "dur": dur,
                "args": {"correlation": correlation}}

    def launch(tid, correlation):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 1, "tid": tid,
                "args": {"correlation": correlation}}

    def op(tid, name, ts, dur):
        return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [kernel(0, 10, 1), kernel(40, 10, 2), kernel(52, 8, 3), kernel(100, 10, 4),
              launch(1, 1), launch(1, 2), launch(1, 3), launch(2, 4),
              op(1, "aten::nonzero", 5, 20), op(1, "aten::copy_", 6, 14),
              op(1, "aten::linear", 30, 8), op(1, "aten::addmm", 31, 6),
              op(1, "aten::add", 65, 30),
              op(2, "autograd::engine::evaluate_function: MmBackward0", 70, 20),
              {"cat": "user_annotation", "name": "vlmshard::vit_embed", "ts": -1, "dur": 10,
               "tid": 1}]
    idle = host_while_idle(events, [e for e in events if e["cat"] == "kernel"])
    assert idle == pytest.approx({"aten::nonzero": 15e-6, "aten::linear": 8e-6,
                                  "autograd::engine::evaluate_function: MmBackward0": 20e-6,
                                  "(python) vit_embed": 7e-6, "(python)": 20e-6})


def test_kernels_go_to_the_layer_that_launched_them_or_made_their_node():
    """Thread 1 runs a ViT block's range [0, 100) and an LLM block's [100, 200); thread 2 (the
    autograd engine) runs backward nodes and an LLM block's recompute range [400, 450). Charged
    by hand: a kernel launched in a range, to its part; one launched by a node, to the part of
    the forward op with the node's sequence number (7: made in the ViT; 9: made in the ViT on
    thread 1 and in the LLM's recompute on thread 2, so the thread with the most ranges, thread
    1, decides: ViT); one launched by the optimizer, or by a node no layer made (11),
    unattributed."""
    import pytest

    def kernel(name, dur, correlation):
        return {"cat": "kernel", "name": name, "ts": 1000 + correlation, "dur": dur,
                "args": {"correlation": correlation}}

    def launch(tid, ts, correlation):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
                "tid": tid, "args": {"correlation": correlation}}

    def span(tid, name, ts, dur, cat="user_annotation", **args):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    node = "autograd::engine::evaluate_function: MmBackward0"
    events = [span(1, "vlmshard::vit_block_0", 0, 100), span(1, "vlmshard::llm_block_3", 100, 100),
              span(2, "vlmshard::llm_block_3", 400, 50),
              span(1, "aten::mm", 10, 5, "cpu_op", **{"Sequence number": 7}),
              span(1, "aten::mul", 50, 5, "cpu_op", **{"Sequence number": 9}),
              span(2, "aten::mul", 410, 5, "cpu_op", **{"Sequence number": 9}),
              span(2, node, 300, 50, "cpu_op", **{"Sequence number": 7}),
              span(2, node, 360, 20, "cpu_op", **{"Sequence number": 9}),
              span(2, node, 500, 20, "cpu_op", **{"Sequence number": 11}),
              launch(1, 20, 1), launch(1, 120, 2), launch(2, 310, 3), launch(2, 370, 4),
              launch(2, 420, 5), launch(2, 510, 6), launch(1, 600, 7),
              kernel("nvjet_tst", 10, 1), kernel("vectorized_elementwise_kernel", 3, 2),
              kernel("nvjet_tst", 20, 3), kernel("nvjet_tst", 5, 4),
              kernel("vectorized_elementwise_kernel", 2, 5), kernel("nvjet_tst", 7, 6),
              kernel("multi_tensor_apply_kernel", 4, 7)]
    got = by_layer(events, [e for e in events if e["cat"] == "kernel"])
    assert got == {"vit_block": {"gemm": pytest.approx(35e-6)},
                   "llm_block": {"elementwise": pytest.approx(5e-6)},
                   "unattributed": {"gemm": pytest.approx(7e-6), "other": pytest.approx(4e-6)}}


def test_a_layer_runs_in_its_range_forward_and_recomputed_while_profiled():
    """Under the profiler a checkpointed layer's range shows twice (its forward, its recompute
    in backward); off the profiler the layer is called as it is."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.checkpoint import checkpoint

    layer = annotated("llm_block_0", lambda x: x.sin() * 2)
    x = torch.randn(8, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        checkpoint(layer, x, use_reentrant=False).sum().backward()
    names = [e.name for e in prof.events() if e.name.startswith("vlmshard::")]
    assert names == ["vlmshard::llm_block_0"] * 2
    torch.testing.assert_close(layer(x), x.sin() * 2)


def _spin(seconds: float) -> None:
    """Python bytecode for ``seconds``: it holds the GIL but for the switch interval."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_host_sampler_charges_each_function_its_time(tmp_path):
    """A thread spinning in Python for 0.3 s, then sleeping 0.2 s (in C, the GIL released): each
    function is charged its own time within a quarter (while the spin holds the GIL the sampler
    reads less often, each reading charged the time since the one before), together the time
    sampled; each site names the function ("tests/test_trace.py:<first line> _spin")."""
    test = test_host_sampler_charges_each_function_its_time.__code__
    with sampled_step(str(tmp_path), 0, 2, True):
        _spin(0.3)
        time.sleep(0.2)
    with open(tmp_path / "host-rank0-step2.json", encoding="utf-8") as f:
        written = json.load(f)
    seconds = written["seconds"]
    spin = seconds.pop(f"tests/test_trace.py:{_spin.__code__.co_firstlineno} _spin")
    here = seconds.pop(f"tests/test_trace.py:{test.co_firstlineno} {test.co_name}")
    assert abs(spin - 0.3) < 0.075 and abs(here - 0.2) < 0.05, (spin, here, seconds)
    assert sum(seconds.values()) < 0.03, seconds  # entering and leaving
    assert written["samples"] > 50 and written["sampled_s"] >= 0.5
    with sampled_step(str(tmp_path), 0, 3, False):
        pass
    assert not (tmp_path / "host-rank0-step3.json").exists()


def test_host_sampler_charges_time_inside_torch_to_its_caller():
    """Frames in torch's own Python (here ``torch.testing``) are charged to the code that
    called into torch."""
    torch.testing.assert_close(torch.ones(1), torch.ones(1))  # its imports, once
    with HostSampler() as sampler:
        for _ in range(300):
            torch.testing.assert_close(torch.ones(300), torch.ones(300))
    test = test_host_sampler_charges_time_inside_torch_to_its_caller.__code__
    site = f"tests/test_trace.py:{test.co_firstlineno} {test.co_name}"
    # nothing is charged to torch's frames; the rest is the sampler's own entering and
    # leaving, which a loaded machine stretches (16% of this loop once, beside a test suite)
    assert sampler.time[site] > 0 and all(
        key == site or (key.startswith("train/trace.py:")
                        and key.endswith((" __enter__", " __exit__")))
        for key in sampler.time), sampler.time
    assert not any("torch/" in site for site in sampler.time), sampler.time
