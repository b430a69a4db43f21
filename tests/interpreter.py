"""The Triton interpreter without its repeated language patching.

Under TRITON_INTERPRET=1 a launch patches `triton.language` for the interpreter, runs every
program, then restores it; but each nested `@triton.jit` call inside a program patches the
same modules again (and drops the patch scope unrestored), walking every member of
`triton.language` with `inspect.getmembers`. On the CPU that is about a fifth of the
interpreter's time in the backend tests. Inside a launch whose patch already covers the
modules a nested function sees (its own, or a nested call's earlier in the launch: those are
never restored), the second patch changes nothing, so it is skipped; any other call patches
as before.

It also looks a Triton dtype's NumPy storage type up in a table built once: the interpreter
builds (and hashes the keys of) that table again for every tile op, a twentieth of its time.
"""

import sys

_launches: list[list] = []  # per running launch: [ids of the modules it has patched, whether patched yet]


def _languages(fn, tl) -> frozenset:
    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def skip_nested_patches() -> None:
    """Install once, if the interpreter is loaded (the tests that run kernels import it)."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    needs = ("_patch_lang", "_LangPatchScope", "GridExecutor")
    if interpreter is None or not all(hasattr(interpreter, name) for name in needs):
        return  # not loaded, or another Triton than constraints.txt pins: interpreted as it comes
    if getattr(interpreter.GridExecutor, "_nested_patches_skipped", False):
        return
    import triton.language as tl

    patch, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__

    def patch_once(fn):
        langs = _languages(fn, tl)
        if _launches and _launches[-1][1] and langs <= _launches[-1][0]:
            return interpreter._LangPatchScope()  # already patched by the running launch: nothing to restore
        scope = patch(fn)
        if _launches:
            _launches[-1][0] |= langs
            _launches[-1][1] = True  # the launch's own patch comes first, restored when its programs end
        return scope

    def tracked_launch(self, *args, **kwargs):
        _launches.append([_languages(self.fn, tl), False])
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launches.pop()

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = tracked_launch
    interpreter.GridExecutor._nested_patches_skipped = True


def table_dtypes() -> None:
    """Install once, if the interpreter is loaded: _get_np_dtype from a table keyed by dtype
    name, built from the interpreter's own answers, with the same result for every dtype."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is None or getattr(interpreter._get_np_dtype, "_tabled", False):
        return
    import triton.language as tl

    slow = interpreter._get_np_dtype
    names = ("int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
             "int64", "uint64", "bfloat16", "float8e5", "float8e5b16", "float8e4nv", "float8e4b8", "float8e4b15")
    table = {getattr(tl, n).name: slow(getattr(tl, n)) for n in names if hasattr(tl, n)}
    pointer, block = tl.pointer_type, tl.block_type

    def tabled(tt_dtype):
        if isinstance(tt_dtype, block):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, pointer):
            return table["uint64"] if "uint64" in table else slow(tt_dtype)
        found = table.get(getattr(tt_dtype, "name", None))
        return found if found is not None else slow(tt_dtype)

    tabled._tabled = True
    interpreter._get_np_dtype = tabled
