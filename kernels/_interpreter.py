"""Triton's interpreter (TRITON_INTERPRET=1): the kernels run on CPU tensors (the tests' interpreter children, the
`--smoke` benchmarks). `interpreting()` says whether they do. Under the interpreter, importing this module applies the one fix
the interpreter needs here, so it is in place before any kernel runs; a compiled run patches nothing.
"""

from __future__ import annotations

from triton import knobs

# triton.jit builds interpreted kernels when TRITON_INTERPRET=1 at their definition, which follows this import.
_INTERPRETED = bool(knobs.runtime.interpret)


def interpreting() -> bool:
    """True when the kernels were built for Triton's interpreter (they then run on CPU tensors)."""
    return _INTERPRETED


def _fix_scalar_index() -> None:
    """triton 3.6's interpreter turns a scalar tensor into a Python int with `int(array)`, which numpy >= 2.4 refuses
    for 1-element arrays ("only 0-dimensional arrays can be converted to Python scalars"), so every `tl.range` over a
    runtime bound fails. This applies the upstream one-line change (https://github.com/triton-lang/triton/pull/9172);
    under numpy < 2.4 it also silences each conversion's DeprecationWarning. Idempotent."""
    import triton.runtime.interpreter as interpreter

    if not getattr(interpreter, "_ikbo_index_fix", False):
        patch_tensor = interpreter._patch_lang_tensor

        def patch_tensor_fixed(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        interpreter._patch_lang_tensor = patch_tensor_fixed
        interpreter._ikbo_index_fix = True


if _INTERPRETED:
    _fix_scalar_index()
