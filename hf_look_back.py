"""The export's transformers classes for a model with the smear or the bigram table.

hf.py copies this file into such an export and names its classes in config.json's auto_map, so that

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

builds the model. It imports only torch and transformers: it runs where this repository is not. Its model_type
("qwen3_look_back", "qwen3_next_look_back") is none that transformers knows, so a load without
trust_remote_code fails rather than build a plain Qwen3 that silently drops the look-back.

The model is transformers' Qwen3ForCausalLM (Qwen3NextForCausalLM for a gated one) with the first layer's input
changed as model.py's GPT.embed_inputs changes it: the token embedding e_t, plus sigmoid(norm(e_t) w) e_{t-1}
(the smear), plus the bigram table's row for the pair (t-1, t). Each position needs the token before it. In one
pass that is the previous input id; in generate, whose later steps feed only the new tokens,
prepare_inputs_for_generation reads it from the whole sequence and passes it as previous_token_ids (a decoding
loop of one's own must pass it too: a forward on a filled cache without it is refused). A position with no
token before it (a sequence's first, or one whose predecessor the attention mask hides: left padding) looks
back at nothing, as in training.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

NO_TOKEN = -1  # the previous id of a position with no token before it
BIGRAM_HASH_MULTIPLIER = 1_000_003  # the bigram hash of model.py, which trained the table


def previous_ids(input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """The id of the token before each position of input_ids [B, T] (a whole sequence from its start): NO_TOKEN
    at the first position and wherever a 2-D attention_mask [B, T] hides the previous one (left padding)."""
    previous = torch.cat([torch.full_like(input_ids[:, :1], NO_TOKEN), input_ids[:, :-1]], dim=1)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        return previous
    seen = torch.cat([torch.zeros_like(attention_mask[:, :1]), attention_mask[:, :-1]], dim=1)
    return previous.masked_fill(seen == 0, NO_TOKEN)


class LookBack(nn.Module):
    """The smear's gate weight and the bigram table, each only where the config has it on."""

    def __init__(self, config):
        super().__init__()
        width, rows = config.hidden_size, getattr(config, "bigram_embed", 0)
        self.eps = config.rms_norm_eps
        self.smear_weight = nn.Parameter(torch.zeros(1, width)) if getattr(config, "smear", False) else None
        self.bigram_embed = nn.Embedding(rows, width) if rows else None

    def forward(self, embed: nn.Embedding, input_ids: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        x = embed(input_ids)
        input_ids, previous = input_ids.long(), previous.to(input_ids.device).long()  # the hash overflows int32
        has_previous = previous != NO_TOKEN
        if self.smear_weight is not None:
            e_before = embed(previous.clamp(min=0)) * has_previous[..., None].to(x.dtype)
            normed = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
            x = x + torch.sigmoid(F.linear(normed, self.smear_weight.to(x.dtype))) * e_before
        if self.bigram_embed is not None:
            rows = self.bigram_embed.num_embeddings
            hashed = (previous * BIGRAM_HASH_MULTIPLIER + input_ids) % (rows - 1)
            x = x + self.bigram_embed(torch.where(has_previous, hashed, rows - 1)).to(x.dtype)
        return x


class LookBackMixin:
    """What the two causal LMs below add to their base class: the look-back module and the two entry points,
    whose signatures are the base class's (generate reads them) plus previous_token_ids."""

    def add_look_back(self, config):
        self.look_back = LookBack(config)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, previous_token_ids=None, **kwargs):
        """The base model's forward on input_ids looked back (inputs_embeds, if given instead, are taken as the
        first layer's input as they are). previous_token_ids [B, T]: the id before each position of input_ids
        (NO_TOKEN for none); needed when a cache holds earlier positions, else read from input_ids."""
        if inputs_embeds is None and input_ids is not None:
            if previous_token_ids is None:
                if cache is not None and cache.get_seq_length() > 0:
                    raise ValueError("a look-back model decoding with a cache needs previous_token_ids [B, T]: the "
                                     "id before each position of input_ids (generate passes them)")
                previous_token_ids = previous_ids(input_ids, attention_mask)
            inputs_embeds = self.look_back(self.get_input_embeddings(), input_ids, previous_token_ids)
        return super().forward(attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                               inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                               logits_to_keep=logits_to_keep, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, **kwargs):
        """The base class's inputs, plus the previous id of each position fed, from the whole sequence and its
        2-D mask (taken before the base class may turn the mask into a static cache's 4-D one)."""
        previous = previous_ids(input_ids, attention_mask)
        inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs)
        fed = inputs.get("input_ids")
        if fed is not None:
            inputs["previous_token_ids"] = previous[:, previous.shape[1] - fed.shape[1]:].to(fed.device)
        return inputs


class LookBackQwen3Config(Qwen3Config):
    model_type = "qwen3_look_back"


class LookBackQwen3NextConfig(Qwen3NextConfig):
    model_type = "qwen3_next_look_back"


class LookBackQwen3ForCausalLM(LookBackMixin, Qwen3ForCausalLM):
    config_class = LookBackQwen3Config

    def __init__(self, config):
        super().__init__(config)
        self.add_look_back(config)


class LookBackQwen3NextForCausalLM(LookBackMixin, Qwen3NextForCausalLM):
    config_class = LookBackQwen3NextConfig

    def __init__(self, config):
        super().__init__(config)
        self.add_look_back(config)
