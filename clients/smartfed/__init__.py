"""SmartFed client side: the MoRE layer.

- :mod:`clients.smartfed.more` — ``MoRELinear`` (routed rank-1 experts), ``apply_more``
  and the packed active-state exchange (torch);
- :mod:`clients.smartfed.config` — ``MoREConfig``.

The LoRA knowledge pool its experts come from is shared (``clients.pool``: the pool folder,
provenance, backbone fingerprint and the split of LoRA adapters into rank-1 experts; numpy only).
Server-side counterparts: :mod:`strategies.eeqa` (quotas) and :mod:`strategies.sparse`
(payload, aggregation). Nothing is imported here.
"""
