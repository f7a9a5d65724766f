"""Loaded by every Python process the tests start (``conftest.child_env`` puts this folder
first on ``PYTHONPATH``).

JAX writes its persistent compilation cache from process 0 only, and on CPU it keys each
entry on the writing process's own devices, so process 1 of a launch never finds an entry
and compiles every program again at every start and every resume. The processes the tests
start share one host and one cache folder in which their keys already differ, so here each
writes its own entries. A hit is still the very executable its key names.
"""

import importlib.abc
import importlib.util
import inspect
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


class _AfterJaxCompiler(importlib.abc.MetaPathFinder):
    """Wraps ``jax._src.compiler._cache_write`` once that module has loaded (importing JAX
    here would slow every process that never uses it)."""

    def find_spec(self, name, path, target=None):
        if name != "jax._src.compiler":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _every_process_writes(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterJaxCompiler())
