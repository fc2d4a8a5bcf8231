"""SmartFed client side: the LoRA knowledge pool and the MoRE layer.

- :mod:`clients.smartfed.pool` — the pool folder, provenance, backbone fingerprint, and the
  split of LoRA adapters into rank-1 experts (numpy only, so a server can read a pool).
- :mod:`clients.smartfed.more` — ``MoRELinear`` (routed rank-1 experts), ``apply_more``
  and the packed active-state exchange (torch).

Server-side counterparts: :mod:`strategies.eeqa` (quotas) and :mod:`strategies.sparse`
(payload, aggregation). Nothing is imported here, so ``import clients.smartfed.pool`` does
not pull in torch.
"""
