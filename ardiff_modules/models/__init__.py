"""Reference models built from the library's layers (torch; import explicitly, like ``distributed``).

* :mod:`ardiff_modules.models.wan_causal_dit` -- a Wan2.1-style causal video DiT over the paged KV cache
  (``WanConfig`` and its presets, ``WanCausalDiT``, ``build_model``, ``make_kv_spec``, ``kv_pool_pages``):
  the model the examples, the benchmarks and the tests run.

``import ardiff_modules`` does not import this package (nor torch); import the model module itself::

    from ardiff_modules.models.wan_causal_dit import WanConfig, build_model, make_kv_spec
"""
