"""cpu_kernels/allocator.py: freed activation memory kept for the next forward on glibc (a prefill's page faults gone,
counted by the kernel), once per process, and nothing set where the user chose the allocator's settings."""

import subprocess
import sys
import textwrap

import pytest

from selfspec.cpu_kernels.allocator import users_own_allocator_settings

PREFILLS = textwrap.dedent("""
    import resource, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from selfspec.cpu_kernels.allocator import keep_freed_memory
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=1000)  # SmolLM2's widths, two layers
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 1000, (1, 400))

    def faults():  # minor page faults of three 400-token prefills, after one that warms up
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=1)
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(3):
                model(input_ids=ids, logits_to_keep=1)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

    before = faults()
    first, second = keep_freed_memory(), keep_freed_memory()
    print(before, first, second, faults())
""")


def _run(env_extra: dict) -> list[str]:
    import os

    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PREFILLS], capture_output=True, text=True, env={**env, **env_extra},
                         check=True)
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_prefill_page_faults_gone_once_set():
    # glibc hands a forward's freed activations back to the kernel and faults them in again (a page at a time); with
    # the thresholds set, the next prefills reuse them: a fraction of the faults (the rest: Python's own objects).
    before, first, second, after = _run({})
    assert first == second == "True"
    assert int(before) > 1000 and int(after) < int(before) / 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_users_own_settings_left_alone():
    before, first, second, after = _run({"MALLOC_ARENA_MAX": "4", "MALLOC_TRIM_THRESHOLD_": "131072"})
    assert first == second == "False"
    assert int(after) > int(before) / 4  # nothing changed: the faults stay
    assert users_own_allocator_settings({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"})
    assert users_own_allocator_settings({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert not users_own_allocator_settings({"LD_PRELOAD": "", "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX"})
