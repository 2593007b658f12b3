"""hixl's tools, beside the library: ``hixl_tools.bench`` (``hixl bench``), ``hixl_tools.demo`` (``hixl demo``),
``hixl_tools.models`` (the numpy SmolLM2 and ``hixl model export``), ``hixl_tools.vllm_launch`` (``vllm serve``
and ``hixl proxy`` processes for the vLLM tests and benchmarks) and ``hixl_tools._perf`` (the benchmarks'
C++ loops over ``hixl._core`` objects). Install: ``pip install ./tools`` from a checkout of hixl, after
``pip install .``. The library (``hixl``) never imports this package.
"""
