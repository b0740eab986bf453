"""Model zoo: which weights of real architectures normflat analyzes, and on which path.

Builds each architecture from a small config with random weights (no downloads): timm vision
models at 64×64 (their own size where they need it), torchvision's classification models (at
64×64, Inception-v3 at 299, the ViT-B/16 and MaxViT at 224), Hugging Face transformers from tiny
configs.
For each, ``normflat.analyze`` with the defaults on two batches (of 2 and 3 samples), then prints
the analyzed fraction of the weight matrices (``coverage``), the layer classes skipped for want of
an extractor (with a warning), the layers on the fast and the generic path with the generic paths'
reasons, and, with ``--check``, the largest difference between the
fast and the generic path's GGN diagonal with chunks of one sample (relative to each tensor's largest
entry; float32, so about 1e-6 is agreement). Models whose random-init logits are (nearly) equal across
classes are analyzed with ``loss="ce"`` (``nsce`` refuses them, as it should).

Run::

    python -m benchmarks.zoo [--family timm hf torchvision] [--check] [--threads 1]

A table, not a timing: the seconds are one analysis on two small batches, for orientation only.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any, Callable

from benchmarks._common import ZOO_HEADER, zoo_row

__all__ = ["TIMM", "TORCHVISION", "hf_models", "survey", "main"]

#: timm architectures (``timm.create_model`` names): CNNs, ViTs, windowed and hybrid attention.
TIMM = (
    "resnet50", "efficientnet_b0", "mobilenetv3_small_100", "regnety_002", "densenet121", "convnext_nano",
    "vit_small_patch16_224", "deit_tiny_patch16_224", "swin_tiny_patch4_window7_224", "beit_base_patch16_224",
    "mixer_b16_224", "resmlp_12_224", "poolformer_s12", "levit_128s", "efficientformer_l1", "mobilevit_xxs",
    "coatnet_nano_rw_224", "maxvit_nano_rw_256", "cait_xxs24_224", "xcit_nano_12_p16_224", "ghostnet_100", "dla34",
    "inception_v3", "pvt_v2_b0", "twins_svt_small", "focalnet_tiny_srf", "nest_tiny", "gcvit_xxtiny",
    "edgenext_xx_small", "davit_tiny", "fastvit_t8", "repvit_m1", "tiny_vit_5m_224", "hgnet_tiny",
    "lambda_resnet26t", "botnet26t_256", "volo_d1_224", "coat_lite_tiny", "pit_ti_224", "tnt_s_patch16_224",
    "visformer_tiny", "swinv2_cr_tiny_224", "eva02_tiny_patch14_224", "resnetv2_50x1_bit", "nf_resnet26",
    "nfnet_l0", "vit_small_r26_s32_224", "tf_efficientnet_b0", "tf_mixnet_s", "mvitv2_tiny",
    "swinv2_tiny_window8_256", "vit_relpos_small_patch16_224",
)


#: torchvision classification models (``torchvision.models.get_model``) and their input size.
TORCHVISION = (
    ("resnet18", 64), ("alexnet", 64), ("vgg11_bn", 64), ("squeezenet1_1", 64), ("densenet121", 64),
    ("inception_v3", 299), ("googlenet", 64), ("shufflenet_v2_x0_5", 64), ("mobilenet_v2", 64),
    ("mobilenet_v3_small", 64), ("mnasnet0_5", 64), ("efficientnet_b0", 64), ("efficientnet_v2_s", 64),
    ("regnet_y_400mf", 64), ("resnext50_32x4d", 64), ("wide_resnet50_2", 64), ("convnext_tiny", 64),
    ("vit_b_16", 224), ("swin_t", 64), ("swin_v2_t", 64), ("maxvit_t", 224),
)


def _torchvision(name: str, size: int) -> tuple[Any, Callable[[int], Any]]:
    import torch
    import torchvision

    model = torchvision.models.get_model(name, num_classes=5).eval()
    g = torch.Generator().manual_seed(0)
    return model, lambda n: (torch.randn(n, 3, size, size, generator=g), torch.randint(0, 5, (n,), generator=g))


def _timm(name: str) -> tuple[Any, Callable[[int], Any]]:
    import timm
    import torch

    kwargs = dict(pretrained=False, num_classes=5)
    try:
        model = timm.create_model(name, img_size=64, **kwargs)
        size = 64
    except TypeError:  # no img_size argument: its own input size
        model = timm.create_model(name, **kwargs)
        size = model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, size, size))
    except Exception:  # noqa: BLE001 - a model built for 64 that needs its own size
        size = model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
    g = torch.Generator().manual_seed(0)
    return model, lambda n: (torch.randn(n, 3, size, size, generator=g), torch.randint(0, 5, (n,), generator=g))


def hf_models() -> dict[str, Callable[[], tuple[Any, Callable[[int], Any]]]]:
    """Hugging Face architectures from tiny configs: ``name -> () -> (model, n -> batch)``."""
    import torch
    import transformers as T

    g = torch.Generator().manual_seed(0)
    small = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=101,
                 max_position_embeddings=32)

    def ids(n: int) -> Any:
        return torch.randint(1, 100, (n, 8), generator=g)

    def classify(n: int) -> dict:
        return {"input_ids": ids(n), "labels": torch.randint(0, 3, (n,), generator=g)}

    def causal(n: int) -> dict:
        x = ids(n)
        return {"input_ids": x, "labels": x.clone()}

    def audio(n: int) -> dict:  # 0.1 s of 16 kHz audio
        return {"input_values": torch.randn(n, 1600, generator=g), "labels": torch.randint(0, 3, (n,), generator=g)}

    def images(n: int) -> dict:
        return {"pixel_values": torch.randn(n, 3, 32, 32, generator=g), "labels": torch.randint(0, 3, (n,), generator=g)}

    vit = dict(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=32, num_labels=3)
    return {
        "bert": lambda: (T.BertForSequenceClassification(T.BertConfig(**small, num_labels=3)), classify),
        "roberta": lambda: (T.RobertaForSequenceClassification(T.RobertaConfig(**small, num_labels=3, pad_token_id=0)),
                            classify),
        "albert": lambda: (T.AlbertForSequenceClassification(T.AlbertConfig(**small, embedding_size=8, num_labels=3)),
                           classify),
        "deberta-v2": lambda: (T.DebertaV2ForSequenceClassification(T.DebertaV2Config(**small, num_labels=3)),
                               classify),
        # DeBERTa-v3's attention (deberta-v3-base's settings): relative positions in buckets, the
        # query and key projections shared with the relative embeddings, those normalized.
        "deberta-v3": lambda: (T.DebertaV2ForSequenceClassification(T.DebertaV2Config(
            **small, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"], share_att_key=True,
            norm_rel_ebd="layer_norm", num_labels=3)), classify),
        # DeBERTa-v2's relative attention: separate position projections, the relative embeddings
        # read unnormalized by every layer.
        "deberta-v2-rel": lambda: (T.DebertaV2ForSequenceClassification(T.DebertaV2Config(
            **small, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"], num_labels=3)),
            classify),
        "longformer": lambda: (T.LongformerForSequenceClassification(T.LongformerConfig(
            **{**small, "max_position_embeddings": 40}, attention_window=4, num_labels=3)), classify),
        # Attention kernels stored raw (d_model, heads, head_dim), applied by einsum (method §3).
        "xlnet": lambda: (T.XLNetForSequenceClassification(T.XLNetConfig(
            d_model=16, n_layer=2, n_head=2, d_inner=32, vocab_size=101, num_labels=3)), classify),
        "funnel": lambda: (T.FunnelForSequenceClassification(T.FunnelConfig(
            d_model=16, n_head=2, d_head=8, d_inner=32, block_sizes=[1, 1], vocab_size=101, num_labels=3)), classify),
        "funnel-factorized": lambda: (T.FunnelForSequenceClassification(T.FunnelConfig(
            d_model=16, n_head=2, d_head=8, d_inner=32, block_sizes=[1, 1], vocab_size=101, num_labels=3,
            attention_type="factorized")), classify),
        "gpt2": lambda: (T.GPT2LMHeadModel(T.GPT2Config(vocab_size=101, n_positions=32, n_embd=16, n_layer=2,
                                                        n_head=2)), causal),
        "llama": lambda: (T.LlamaForCausalLM(T.LlamaConfig(**small, num_key_value_heads=1)), causal),
        "qwen2": lambda: (T.Qwen2ForCausalLM(T.Qwen2Config(**small, num_key_value_heads=1)), causal),
        "gemma": lambda: (T.GemmaForCausalLM(T.GemmaConfig(**small, head_dim=8, num_key_value_heads=1)), causal),
        "phi": lambda: (T.PhiForCausalLM(T.PhiConfig(**small)), causal),
        "falcon": lambda: (T.FalconForCausalLM(T.FalconConfig(**small)), causal),
        "opt": lambda: (T.OPTForCausalLM(T.OPTConfig(vocab_size=101, hidden_size=16, num_hidden_layers=2,
                                                     num_attention_heads=2, ffn_dim=32, max_position_embeddings=32,
                                                     word_embed_proj_dim=16)), causal),
        "mbart": lambda: (T.MBartForCausalLM(T.MBartConfig(vocab_size=101, d_model=16, decoder_layers=1,
                                                           decoder_attention_heads=2, decoder_ffn_dim=32,
                                                           max_position_embeddings=32, scale_embedding=True)), causal),
        "t5": lambda: (T.T5ForConditionalGeneration(T.T5Config(vocab_size=101, d_model=16, d_kv=8, d_ff=32,
                                                               num_layers=1, num_heads=2, decoder_start_token_id=0)),
                       lambda n: {"input_ids": ids(n), "labels": torch.randint(1, 100, (n, 5), generator=g)}),
        "mixtral": lambda: (T.MixtralForCausalLM(T.MixtralConfig(**small, num_key_value_heads=1, num_local_experts=4,
                                                                 num_experts_per_tok=2)), causal),
        "qwen2-moe": lambda: (T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            **small, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16)), causal),
        "olmoe": lambda: (T.OlmoeForCausalLM(T.OlmoeConfig(**small, num_key_value_heads=1, num_experts=4,
                                                             num_experts_per_tok=2)), causal),
        "deepseek-v2": lambda: (T.DeepseekV2ForCausalLM(T.DeepseekV2Config(
            **small, num_key_value_heads=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1)), causal),
        "gpt-oss": lambda: (T.GptOssForCausalLM(T.GptOssConfig(**small, num_key_value_heads=1, head_dim=8,
                                                                num_local_experts=4, num_experts_per_tok=2)), causal),
        "phimoe": lambda: (T.PhimoeForCausalLM(T.PhimoeConfig(**small, num_key_value_heads=1, num_local_experts=4,
                                                               num_experts_per_tok=2)), causal),
        "mistral": lambda: (T.MistralForCausalLM(T.MistralConfig(**small, num_key_value_heads=1)), causal),
        "qwen3": lambda: (T.Qwen3ForCausalLM(T.Qwen3Config(**small, num_key_value_heads=1, head_dim=8)), causal),
        "gemma2": lambda: (T.Gemma2ForCausalLM(T.Gemma2Config(**small, head_dim=8, num_key_value_heads=1)), causal),
        "gpt-neox": lambda: (T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**small)), causal),
        "bloom": lambda: (T.BloomForCausalLM(T.BloomConfig(vocab_size=101, hidden_size=16, n_layer=2, n_head=2)),
                          causal),
        "mamba": lambda: (T.MambaForCausalLM(T.MambaConfig(vocab_size=101, hidden_size=16, state_size=4,
                                                           num_hidden_layers=2, expand=2, conv_kernel=3)), causal),
        # Hybrid language models whose mixers convolve with their nn.Conv1d's weight themselves.
        "mamba2": lambda: (T.Mamba2ForCausalLM(T.Mamba2Config(vocab_size=101, hidden_size=16, state_size=4,
                                                              num_hidden_layers=2, expand=2, conv_kernel=3,
                                                              num_heads=4, head_dim=8, n_groups=1, chunk_size=4)),
                           causal),
        "falcon-mamba": lambda: (T.FalconMambaForCausalLM(T.FalconMambaConfig(
            vocab_size=101, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=3)), causal),
        "jamba": lambda: (T.JambaForCausalLM(T.JambaConfig(
            **small, num_key_value_heads=1, num_experts=2, expert_layer_period=2, expert_layer_offset=1,
            attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=3, mamba_expand=2,
            use_mamba_kernels=False)), causal),
        "bamba": lambda: (T.BambaForCausalLM(T.BambaConfig(
            **small, num_key_value_heads=1, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=4,
            mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=4, attn_layer_indices=[1])), causal),
        "qwen3-next": lambda: (T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
            **small, num_key_value_heads=1, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=3, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            layer_types=["linear_attention", "full_attention"])), causal),
        "lfm2": lambda: (T.Lfm2ForCausalLM(T.Lfm2Config(
            vocab_size=101, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, conv_L_cache=3, layer_types=["conv", "full_attention"],
            max_position_embeddings=32)), causal),
        "zamba2": lambda: (T.Zamba2ForCausalLM(T.Zamba2Config(
            vocab_size=101, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, mamba_headdim=8, mamba_ngroups=1, n_mamba_heads=4,
            chunk_size=4, layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1], max_position_embeddings=32,
            attention_head_dim=8, intermediate_size=32)), causal),
        "recurrent-gemma": lambda: (T.RecurrentGemmaForCausalLM(T.RecurrentGemmaConfig(
            vocab_size=101, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, lru_width=16, attention_window_size=8, conv1d_width=3, head_dim=8,
            block_types=["recurrent", "attention"])), causal),
        "rwkv": lambda: (T.RwkvForCausalLM(T.RwkvConfig(vocab_size=101, context_length=32, hidden_size=16,
                                                        num_hidden_layers=2, attention_hidden_size=16,
                                                        intermediate_size=32)), causal),
        "modernbert": lambda: (T.ModernBertForSequenceClassification(T.ModernBertConfig(
            vocab_size=101, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=32, num_labels=3, pad_token_id=0)), classify),
        "distilbert": lambda: (T.DistilBertForSequenceClassification(T.DistilBertConfig(
            vocab_size=101, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=32,
            num_labels=3)), classify),
        "electra": lambda: (T.ElectraForSequenceClassification(T.ElectraConfig(**small, embedding_size=8,
                                                                               num_labels=3)), classify),
        "bart": lambda: (T.BartForSequenceClassification(T.BartConfig(
            vocab_size=101, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
            num_labels=3, eos_token_id=2, pad_token_id=0)),
            lambda n: {"input_ids": torch.cat([torch.randint(3, 100, (n, 8), generator=g), torch.full((n, 1), 2)], 1),
                       "labels": torch.randint(0, 3, (n,), generator=g)}),
        "vit": lambda: (T.ViTForImageClassification(T.ViTConfig(**vit)), images),
        "dinov2": lambda: (T.Dinov2ForImageClassification(T.Dinov2Config(**vit)), images),
        "convnext": lambda: (T.ConvNextForImageClassification(T.ConvNextConfig(
            num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)), images),
        "swin": lambda: (T.SwinForImageClassification(T.SwinConfig(image_size=32, patch_size=2, embed_dim=8,
                                                                   depths=[1, 1], num_heads=[1, 1], window_size=4,
                                                                   num_labels=3)), images),
        "swinv2": lambda: (T.Swinv2ForImageClassification(T.Swinv2Config(
            image_size=32, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[1, 1], window_size=4,
            num_labels=3)), images),
        "wav2vec2": lambda: (T.Wav2Vec2ForSequenceClassification(T.Wav2Vec2Config(
            **small, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2, classifier_proj_size=8, num_labels=3)), audio),
        "hubert": lambda: (T.HubertForSequenceClassification(T.HubertConfig(
            **small, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2, classifier_proj_size=8, num_labels=3)), audio),
        "wavlm": lambda: (T.WavLMForSequenceClassification(T.WavLMConfig(
            **small, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2, classifier_proj_size=8, num_buckets=8, num_labels=3)), audio),
        "bit": lambda: (T.BitForImageClassification(T.BitConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                                num_groups=2, layer_type="preactivation",
                                                                global_padding="SAME", num_labels=3)), images),
        "resnet": lambda: (T.ResNetForImageClassification(T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16],
                                                                         depths=[1, 1], num_labels=3)), images),
        "segformer": lambda: (T.SegformerForImageClassification(T.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], num_attention_heads=[1, 2],
            patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=3)), images),
    }


def survey(name: str, build: Callable[[], tuple[Any, Callable[[int], Any]]], check: bool) -> str:
    """One table row for the model ``build()`` makes (its errors, too: the row says what failed;
    :func:`benchmarks._common.zoo_row`, the diagonals checked with chunks of one sample)."""
    return zoo_row(name, build, check, parameters=lambda model: f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M",
                   largest=lambda a: float(a.abs().max()), check_options={"chunk_size": 1})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="*", default=["timm", "hf", "torchvision"],
                        choices=["timm", "hf", "torchvision"])
    parser.add_argument("--check", action="store_true", help="fast against generic path with chunks of one sample")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="*", default=None, metavar="NAME",
                        help="only these rows (names as in the table, without the 'tv '/'HF ' prefix)")
    args = parser.parse_args(argv)

    def wanted(name: str) -> bool:
        return args.models is None or name in args.models
    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print("\n".join(ZOO_HEADER))
    if "timm" in args.family:
        for name in filter(wanted, TIMM):
            torch.manual_seed(0)
            print(survey(name, lambda name=name: _timm(name), args.check), flush=True)
    if "torchvision" in args.family:
        for name, size in TORCHVISION:
            if not wanted(name):
                continue
            torch.manual_seed(0)
            print(survey(f"tv {name}", lambda name=name, size=size: _torchvision(name, size), args.check), flush=True)
    if "hf" in args.family:
        import transformers

        transformers.logging.set_verbosity_error()
        for name, build in hf_models().items():
            if not wanted(name):
                continue
            torch.manual_seed(0)
            print(survey(f"HF {name}", build, args.check), flush=True)


if __name__ == "__main__":
    main()
