"""FedNL against the baselines on the embedded SmolLM2, sized for 2 CPU cores (<= 60 min).

    .venv/bin/python -m bench.fednl --write-docs            # the full CPU benchmark
    .venv/bin/python -m bench.fednl --quick --out /tmp/fednl-quick   # a pipeline check on the tiny model (alias --smoke)

Sections (``--sections``, all by default), each a real Flower simulation or measurement:

1. ``mmlu``: 5-client non-IID MMLU (one super-category per client) for fedavg-lora,
   fedprox, ffa-lora, fedala, fedssi and FedNL in both payload modes, ``--rounds`` rounds
   of ``--local-steps`` steps; per-client and average accuracy of the last round,
   uplink/downlink payload bytes per client per round, and the aggregation drop per client
   (the client's own model before aggregation vs the federated one, same round, same test
   questions; for the pairs that report it: FedNL, FedALA, FedSSI). ``fednl:ablate`` is FedNL's
   own ablation (the memory path off, everything else as in meta-rules mode). With
   ``--paired`` every final model and the untrained ones (round 0) are scored item by item on
   every client's held-out questions (``--mmlu-test`` per client; 700 gives 2,257) and
   compared paired (``postcard.compare``): each method against fedavg-lora (95% interval,
   McNemar, non-inferiority at ``--margin``), FedNL against its ablation, each method against
   its own round 0.
2. ``niah``: 7-client needle-in-a-haystack (one template per client), FedNL (softmax
   window ``--window``, the memory carries the rest), its ablation (the same window, memory
   off) and fedavg-lora (``--niah-algorithms``) trained on ``--niah-train-length``-token
   prompts, then every client's test prompts at ``--niah-lengths`` scored prompt by prompt
   with the final global model; FedNL paired against each of the others at every length.
3. ``stream``: one ``--stream-length``-token NIAH prompt streamed block by block through
   FedNL's recurrent form (and its ablation's) and through fedavg-lora's model (adapter merged
   into the backbone) with its KV cache, each in a fresh process: normalised CE per 1K-token bin
   relative to the first bin, and peak inference memory at ``--memory-lengths`` tokens
   (peak RSS above the loaded model; CUDA: allocator peak), with the carried state's bytes.
   Uses the ``niah`` section's trained models (the section runs it if needed), with
   ``--stream-from lm`` the ``lm`` section's (FedNL's window is then ``--lm-window``), or
   with ``--stream-from init`` the untrained ones (FedNL at init, the bare backbone).
4. ``throughput``: training tokens/s of FedNL (memory + LoRA q/k/v) vs plain LoRA on
   q/k/v with the same rank, same batch, interleaved timed steps.
5. ``lm``: what the memory adds where the softmax path cannot see: 4-client Shakespeare
   (one play each) on ``--lm-seq``-token windows, FedNL's softmax path limited to its 4
   sink tokens and the last ``--lm-window`` tokens; held-out loss window by window of the
   untrained backbone (full attention; the window without and with sinks), then of FedNL,
   its ablation (same window and sinks, memory off) and fedavg-lora (full attention) after
   ``--lm-rounds`` rounds; FedNL paired against its ablation, α per layer at the end.
6. ``passkey``: the bounds of the retrieval comparison (issue #44), before any training: the same
   held-out ``task=passkey`` prompts (a 5-digit key ``--passkey-min-distance`` or more tokens before
   the prompt's end, at ``--passkey-lengths``) scored by exact match by the untrained backbone with
   full attention and by FedNL's ablation (memory off) with each softmax window of
   ``--passkey-windows`` plus ``--passkey-sink`` sinks; per length and by the key's distance.

Targets from the issue: FedNL's peak memory grows <= 1.1x from the first to the last
memory length; FedNL trains at >= 0.9x plain LoRA's tokens/s (issue #15; 0.7x before it). ``--write-docs`` puts the
tables (with the command that made them) into ``docs/fednl.md`` between its bench markers
and the plots into ``docs/fednl-*.png``; every run also leaves ``results.json`` and the
run folders under ``--out``.

Modules: ``cli`` (the flags, the sections in order), ``runs`` (what every section's runs share),
one per section (``mmlu``, ``niah``, ``stream``, ``throughput``, ``lm``), ``stats`` (the paired
comparisons and intervals), ``report`` (the tables), ``docs`` (plots, ``--write-docs``, ``--render``).
"""
