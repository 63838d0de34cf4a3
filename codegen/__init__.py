"""Code generation from compiled masks: TileLang preprocess programs, CuTe predicates."""


def tilelang_source(mask, target: str = "cuda") -> str:
    from compilemask.codegen.preprocess import tilelang_source as _src

    return _src(mask, target=target)


__all__ = ["tilelang_source"]
