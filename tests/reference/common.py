"""Helpers shared by the reference tests: everything of plans.py (run the binaries, write plans and
token files), and tiny Hugging Face models built with torch."""
import torch

from plans import *  # noqa: F401,F403  (re-exported: the tests import them from here)
from plans import SEQ

torch.set_num_threads(2)


def hf_model(arch, seed=0, tied=False, activation="gelu_new"):
    """A transformers model with random weights (norm weights and biases perturbed too); `tied`:
    a llama whose head is its embedding (Llama-3.2 1B/3B style; gpt2 is always tied);
    `activation`: gpt2's activation_function (relu2: model.mlp relu2)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    m = model_plan(arch)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=m["vocab_size"], n_positions=m["max_seq_len"], n_embd=m["hidden"],
                         n_layer=m["layers"], n_head=m["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         layer_norm_epsilon=m["norm_eps"], activation_function=activation,
                         attn_implementation="eager")
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden"], intermediate_size=m["ffn_hidden"],
                          num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                          num_key_value_heads=m["kv_heads"], max_position_embeddings=m["max_seq_len"],
                          rms_norm_eps=m["norm_eps"], rope_theta=m["rope_theta"], tie_word_embeddings=tied,
                          attn_implementation="eager")
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model.float().eval()


def hf_loss(model, rows):
    """Mean next-token loss of int64 rows [B, T+1] (fp32 logits)."""
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                 rows[:, 1:].reshape(-1)).item()


def write_rows(path, rows):
    """The `score` tokens file: raw little-endian int32 rows of T+1 tokens."""
    rows.to(torch.int32).numpy().astype("<i4").tofile(path)


def random_rows(batch, vocab=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, SEQ + 1), generator=g)
