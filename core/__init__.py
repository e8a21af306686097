"""The shared base every package stands on: config access (config.py), expected mistakes (errors.py), the CPU runtime
(runtime.py), loading and fingerprinting the target (target.py), KV-cache and mask helpers (kv.py), generic pieces of
a decoder-only CausalLM (layers.py), and the tolerant record reader that training data and the suffix drafter's corpus
share (records.py). It imports none of the other rooms."""
