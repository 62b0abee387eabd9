"""Tests of torch's c10d conformance suite (distributed_test.py) that gloo
passes on CPU and tccomm does not run, each with the reason.

tests/test_torch_conformance.py fails when a name here is no longer a test
of torch's suite, and (TCCOMM_CONFORMANCE=full) when a test here passes on
tccomm after all: the list cannot outlive its reasons.
"""

_MONITORED_BARRIER = (
    "dist.monitored_barrier is a gloo-only API: torch's c10d::Backend::monitoredBarrier "
    "raises 'only GLOO supports monitored barrier' for every other backend, and the "
    "test expects gloo's own messages ('Rank 1 failed to pass monitoredBarrier')")

SKIPS: dict[str, str] = {
    "test_monitored_barrier_gloo": _MONITORED_BARRIER,
    "test_monitored_barrier_gloo_rank_0_timeout": _MONITORED_BARRIER,
    "test_monitored_barrier_gloo_subgroup": _MONITORED_BARRIER,
    "test_ddp_logging_data_cpu": (
        "DDP's logger records ProcessGroup::getBackendName(), which torch returns as "
        "'custom' for every backend registered with dist.Backend.register_backend (the "
        "ProcessGroup is torch's, not the backend's); the test compares it with "
        "dist.get_backend() == 'tccomm'. Every other field of the test's DDP logging data "
        "is the backend-independent part"),
}
