"""Test setup: eight simulated CPU devices, set before JAX is imported."""

import os
from pathlib import Path

# The tests' programs are tiny and compiling them is most of the suite's time: LLVM's
# cheapest pipeline runs the suite about 30% faster on 2 cores. Programs compiled so can
# differ from the default's in the last bit (a fused multiply-add or not), which the tests'
# float tolerances allow; bit-exact comparisons are between programs compiled alike:
# processes the tests start get these flags too (``child_env``). XLA's older fusion
# emitters would compile about 14% faster, but they fuse otherwise, and the simulated
# clock reads the compiled program's cost analysis, so the tests keep the default ones.
_COMPILE_FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" {_COMPILE_FAST} --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same programs again (a resumed trainer, the same step in another
# test, the processes a launcher starts): JAX's compilation cache, in a folder of this
# session's own, shared by the pytest workers and the processes they start, compiles each
# once. The cache keys on the whole program, so a hit is the very executable.
_OWN_CACHE = None  # the folder this process made (workers and sub-sessions inherit it)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxcomm-tests-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

_CHILD_SITE = str(Path(__file__).parent / "_child_site")


def child_env() -> dict[str, str]:
    """The environment for a process a test starts: this one, with XLA's flags but not the
    device count (the started process sets its own), and ``_child_site`` first on
    ``PYTHONPATH`` (every process writes its own compilation cache entries)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if "device_count" not in f)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_CHILD_SITE, env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="session")
def mesh8():
    """A one-dimensional mesh of the eight CPU devices, axis name ``data``."""
    return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="session")
def run_tx():
    """Driver for an optax transform per worker inside shard_map over ``data``.

    ``run_tx(mesh, tx, grads_seq [T, N, d], params [N, d])`` applies ``tx.update`` for T steps
    on every worker and returns ``(updates [N, T, d], final state with a leading N axis)``.
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def _run_tx(mesh, tx, grads_seq, params):
        """Apply ``tx`` for len(grads_seq) steps per worker; grads_seq: [T, N, d]."""

        def per_worker(g_seq, p):
            p = p[0]

            def one_step(state, g):  # one program for every step: compiled once
                upd, state = tx.update(g[0], state, p)
                return state, upd

            state, outs = jax.lax.scan(one_step, tx.init(p), g_seq)
            return outs[None], jax.tree_util.tree_map(lambda a: a[None], state)

        f = jax.shard_map(
            per_worker, mesh=mesh, in_specs=(P(None, "data"), P("data")), out_specs=P("data")
        )
        g = jax.device_put(grads_seq, NamedSharding(mesh, P(None, "data")))
        p = jax.device_put(params, NamedSharding(mesh, P("data")))
        return jax.jit(f)(g, p)

    return _run_tx


# `pytest -m quick`: a few tests from each layer that check an install in about a minute
# (codecs, collectives against lax, the user's step, a training run that learns, resume,
# the command line). The full suite is what CI runs.
QUICK = (
    "test_codecs.py::test_quantizer_unbiased",
    "test_codecs.py::test_topk_roundtrip_and_bytes",
    "test_collectives.py::test_ring_all_reduce_equals_psum",
    "test_collectives.py::test_tree_all_reduce_equals_psum",
    "test_user_step.py::test_user_step_gives_the_rule_on_each_workers_own_gradient[ring]",
    "test_user_step.py::test_user_step_gives_the_rule_on_each_workers_own_gradient[ec_quantized]",
    "test_trainer.py::test_mlp_loss_goes_down_and_files_written",
    "test_lose_nothing.py::test_arrays_equal_on_every_worker_are_saved_once_and_restored_bit",
    "test_lose_nothing.py::test_resuming_a_finished_run_changes_nothing_and_can_go_further",
    "test_cli.py::test_help_lists_configs_aggregators_sync_methods_and_the_network_syntax",
    "test_cli.py::test_a_misspelled_choice_gets_did_you_mean",
)


# `pytest -m slow`: variants of a multi-process or long path whose feature the default run
# already covers once (a second layout, another process count, another crossing of two
# features), minutes each. `pytest` (CI) leaves them out; `pytest -m slow` runs them alone
# and `pytest -m "slow or not slow"` runs everything. A test named by node id always runs.
SLOW = (
    # Two-process resume of each crossing: pipeline_diloco (a pipeline across processes with
    # DiLoCo's fragments, overlap and int8, AQ-SGD's buffers) stays in the default run.
    "test_distributed.py::test_new_combinations_on_two_processes_resume_bit_exactly[dp_diloco]",
    "test_distributed.py::test_new_combinations_on_two_processes_resume_bit_exactly[dp_adaptive]",
    "test_distributed.py::test_new_combinations_on_two_processes_resume_bit_exactly[pipeline_adaptive]",
    "test_distributed.py::test_new_combinations_on_two_processes_resume_bit_exactly[local_sgd_stragglers]",
    # Replica groups: the default run keeps the equality with one program, the kill and heal
    # of a group beside a 2-process group, the 1-process resume and every bad-input test.
    "test_groups_torchft.py::test_a_killed_group_leaves_the_other_training_and_a_restart_is_"
    "healed[2 stages]",
    "test_groups_torchft.py::test_groups_of_pipelines_equal_one_programs_pipeline_diloco",
    "test_groups_torchft.py::test_a_group_of_two_processes_is_healed_and_its_processes_agree",
    "test_groups_torchft.py::test_a_stopped_run_of_int8_groups_resumes_bit_exactly[2 processes]",
    "test_groups_torchft.py::test_a_stopped_run_of_int8_groups_resumes_bit_exactly[2 stages]",
    # In one process: the pipeline against the plain model at 4 stages stays (2 and 8 are
    # the same program at other depths), and DreamDDP's averaging of a pipeline's replicas
    # (local SGD's is its schedule with every layer at one step).
    "test_pipeline.py::test_fp32_pipeline_equals_unpipelined_model[2]",
    "test_pipeline.py::test_fp32_pipeline_equals_unpipelined_model[8]",
    "test_pipeline_trainer.py::test_pipeline_replicas_synchronise_by_local_sgd[local_sgd]",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the install check (`pytest -m quick`)")
    config.addinivalue_line("markers", "slow: left out of `pytest`; `pytest -m slow` runs them")


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    matched = set()
    for item in items:
        name = item.nodeid.split("tests/", 1)[-1]
        hits = [q for q in QUICK if name.startswith(q)]
        if hits:
            item.add_marker(pytest.mark.quick)
            matched.update(hits)
        slow = [q for q in SLOW if name == q]
        if slow:
            item.add_marker(pytest.mark.slow)
            matched.update(slow)
    # A file whose tests were chosen by node id: its other tests were never collected.
    chosen = {Path(str(a).split("::")[0]).name for a in config.args if "::" in str(a)}
    files = {item.nodeid.split("tests/", 1)[-1].split("::")[0] for item in items}
    here = Path(__file__).parent
    stale = [
        q
        for q in (*QUICK, *SLOW)
        if q not in matched
        and Path(q.split("::")[0]).name not in chosen
        and (q.split("::")[0] in files or not (here / q.split("::")[0]).exists())
    ]
    if stale:
        raise pytest.UsageError(
            f"tests/conftest.py QUICK or SLOW names tests that do not exist: {stale}"
        )
    if not config.option.markexpr:  # no -m: the default run leaves the slow tier out
        named = [Path(a.split("::")[0]).name + "::" + a.split("::", 1)[1] for a in config.args
                 if "::" in a]  # fmt: skip
        out = [
            i
            for i in items
            if i.get_closest_marker("slow")
            and not any(i.nodeid.split("tests/", 1)[-1].startswith(n) for n in named)
        ]
        if out:
            config.hook.pytest_deselected(items=out)
            items[:] = [i for i in items if i not in out]


def pytest_unconfigure(config):
    """The session's compilation cache goes when the session that made it ends (not when a
    worker, or a pytest run started by a test, ends)."""
    if _OWN_CACHE is not None and not hasattr(config, "workerinput"):
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
