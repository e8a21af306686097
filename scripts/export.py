"""Export trained heads in the format a serving engine loads, and optionally push them to the Hugging Face Hub.

    # Medusa heads -> vLLM's Medusa format (config.json + model.safetensors) in outputs/medusa-smollm2/heads-vllm
    python scripts/export.py heads=outputs/medusa-smollm2/heads
    # EAGLE-3 heads trained with heads.layout=midlayer -> SGLang / vLLM (LlamaForCausalLMEagle3), or speculators
    python scripts/export.py heads=outputs/eagle3-smollm2/heads format=eagle3 out=exports/eagle3-smollm2
    python scripts/export.py heads=outputs/eagle3-smollm2/heads format=speculators dtype=bfloat16
    # upload the exported folder to a Hub model repo (needs `huggingface-cli login` or HF_TOKEN)
    python scripts/export.py heads=outputs/medusa-smollm2/heads push_to_hub=org/name private=true
    # the installed command takes the same overrides (serve/cli.py)
    selfspec-export heads=outputs/medusa-smollm2/heads

Formats and what each holds: heads/export.py. The target the heads record is loaded to check that the heads were
trained for it (and to read the LM head / embedding the formats include); ``model=`` names another copy of it.
"""

from selfspec.serve.cli import export_main

if __name__ == "__main__":
    export_main()
