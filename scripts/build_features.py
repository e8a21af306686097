"""Build a feature store once, for every later training run that reads it (see train/features.py, conf/features.yaml).

    python scripts/build_features.py model=smollm2 feature_store.dir=outputs/stores/smollm2
    python scripts/build_features.py model=llama8b feature_store.dir=/shared/stores/llama8b feature_store.engine=vllm \
        feature_store.vllm.tensor_parallel_size=2 feature_store.vllm.data_parallel_size=4
    python scripts/build_features.py model=qwen3_30b_a3b feature_store.dir=DIR feature_store.device_map=auto
    accelerate launch --num_processes 8 scripts/build_features.py model=llama8b feature_store.dir=DIR   # HF replicas
    selfspec-features model=tiny data.max_records=64 feature_store.dir=outputs/stores/tiny             # installed

Then train from it with the same model= and data settings: `train/eagle.py heads=eagle3 features=store
feature_store.dir=DIR` or `train/dflash.py features=store feature_store.dir=DIR`: no engine starts there. Rerunning
a killed build resumes from the shards it wrote.
"""

from selfspec.train.cli import features_main

if __name__ == "__main__":
    features_main()
