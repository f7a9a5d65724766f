"""Loaded by every Python process the tests start (``conftest.child_env`` puts this folder
first on ``PYTHONPATH``).

JAX writes its persistent compilation cache from process 0 only, and on CPU it keys each
entry on the writing process's own devices, so process 1 of a launch never finds an entry
and compiles every program again at every start and every resume. The processes the tests
start share one host and one cache folder in which their keys already differ, so here each
writes its own entries. A hit is still the very executable its key names.

With ``JAXCOMM_TEST_FAIL_EXCHANGE_AT`` set, a replica group's exchange launched at that
step fails (see :func:`_fail_an_exchange`).
"""

import importlib.abc
import importlib.util
import inspect
import os
import sys
import warnings


def _every_process_writes(compiler) -> None:
    write = compiler._cache_write
    state = compiler.distributed.global_state
    signature = inspect.signature(write)  # JAX 0.12 dropped ``host_callbacks`` from it

    def cache_write(*args, **kwargs):
        if state.process_id == 0:
            return write(*args, **kwargs)
        # JAX's own conditions but the process's (the global process id is left alone:
        # other threads read it).
        a = signature.bind(*args, **kwargs).arguments
        seconds = a["compile_time_secs"]
        if a.get("host_callbacks"):
            return None
        if seconds < compiler.config.persistent_cache_min_compile_time_secs.value:
            return None
        try:
            compiler.compilation_cache.put_executable_and_time(
                a["cache_key"], a["module_name"], a["executable"], a["backend"], int(seconds)
            )
        except Exception as ex:  # a failed write costs a compile later, nothing more
            warnings.warn(f"cache entry {a['module_name']!r} not written: {ex}", stacklevel=2)
        return None

    compiler._cache_write = cache_write


def _fail_an_exchange(module) -> None:
    """``JAXCOMM_TEST_FAIL_EXCHANGE_AT=S``: the exchange of a fragment launched at training
    step ``S`` (``train.replica.Transport.exchange``, a group's leader) fails as if every try
    of it had, before it reaches the other groups (a test of what a group does then)."""
    at = int(os.environ["JAXCOMM_TEST_FAIL_EXCHANGE_AT"])
    exchange = module.Transport.exchange
    step, fragment = module.FIELDS.index("step"), module.FIELDS.index("fragment")

    def failing(self, header, *args, **kwargs):
        mine = header(False)
        if mine[fragment] >= 0 and mine[step] == at:
            return None
        return exchange(self, header, *args, **kwargs)

    module.Transport.exchange = failing


class _After(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once module ``name`` has loaded (importing it here would slow
    every process that never uses it)."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _After("jax._src.compiler", _every_process_writes))
if os.environ.get("JAXCOMM_TEST_FAIL_EXCHANGE_AT"):
    sys.meta_path.insert(0, _After("train.replica", _fail_an_exchange))
