"""Hugging Face interop, offline with tiny configs: paratrain's logits equal transformers' for the same weights,
exported (paratrain → HF) and loaded (HF → paratrain, spec.model.init), for Llama and GPT-2; and a tensor-parallel
run started from HF weights begins at the single-process run's loss."""

import json
import weakref
from collections.abc import Mapping

import pytest
import torch
import transformers
from safetensors import safe_open

from paratrain.api import parse_job
from paratrain.train.data import TRAIN_STREAM, global_batch, load_corpus
from paratrain.train.loss import cross_entropy
from paratrain.train.models.hf import export_hf, load_hf_into
from paratrain.train.models.hf_config import init_problem
from paratrain.train.models.registry import build_model, model_config
from paratrain.train.models.weights import init_weights

from ..harness import TINY_JOB, assert_close_curves, layout, run_job

VOCAB = 64
MODELS = {
    "llama": {"family": "llama", "layers": 2, "heads": 4, "kvHeads": 2, "embedDim": 32, "ffnDim": 64,
              "ropeTheta": 500000.0, "blockSize": 16, "vocabSize": VOCAB},
    "gpt": {"layers": 2, "heads": 4, "embedDim": 32, "ffnDim": 48, "blockSize": 16, "vocabSize": VOCAB},
}
HF_CLASSES = {"llama": transformers.LlamaForCausalLM, "gpt": transformers.GPT2LMHeadModel}


def job(family: str, **model):
    return parse_job({**TINY_JOB, "spec": {**TINY_JOB["spec"], "model": {**MODELS[family], **model}}})


def tokens() -> torch.Tensor:
    return torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def paratrain_model(job_, seed: int = 1):
    model = build_model(model_config(job_.spec, VOCAB))
    init_weights(model, seed)
    return model.eval()


def hf_logits(directory) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(tokens()).logits


@pytest.mark.parametrize("family", MODELS)
def test_exported_model_gives_paratrains_logits_in_transformers(family, tmp_path):
    j = job(family)
    model = paratrain_model(j)
    export_hf(j, model.state_dict(), tmp_path)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path)) is HF_CLASSES[family]
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(tmp_path), model(tokens()), rtol=1e-4, atol=1e-5)  # logits ~0.4; observed ~1e-7


def test_a_gpt_without_biases_exports_zero_biases_and_loads_back(tmp_path):
    """model.bias false (nanoGPT's bias=False): GPT-2 has the MLP's and LayerNorms' biases, so export writes them as
    zeros (transformers gives paratrain's logits), and loading reads the weights back exactly; a directory whose
    LayerNorm bias is not zero cannot be loaded into the bias-free model."""
    j = job("gpt", bias=False)
    model = paratrain_model(j)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    export_hf(j, model.state_dict(), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(tmp_path), model(tokens()), rtol=1e-4, atol=1e-5)
    back = build_model(model_config(j.spec, VOCAB))
    load_hf_into(back, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    hf = hf_random_model("gpt", tmp_path / "hf")
    with torch.no_grad():
        hf.transformer.h[1].ln_2.bias.fill_(0.1)
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"transformer.h.1.ln_2.bias is not zero: .* model.bias is false"):
        load_hf_into(build_model(model_config(j.spec, VOCAB)), tmp_path / "hf")


def test_a_model_over_the_shard_size_is_written_in_shards_with_an_index_transformers_loads(tmp_path):
    """--max-shard-size 20 KB and --dtype bf16 on the tiny Llama (43 KB in bf16): shards as transformers names
    them, each within the limit, an index naming every tensor; transformers loads them in bf16 and gives the fp32
    model's logits within bf16's rounding; spec.model.init reads them back; a later single-file export into the
    same directory leaves no shard behind."""
    j = job("llama")
    model = paratrain_model(j)
    export_hf(j, model.state_dict(), tmp_path, max_shard_bytes=20_000, dtype="bf16")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all((tmp_path / f).stat().st_size < 20_000 + 4096 for f in files)  # a safetensors header beside
    assert index["metadata"]["total_size"] == 2 * sum(t.numel() for t in model.state_dict().values())
    assert not (tmp_path / "model.safetensors").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens()).logits.float(), model(tokens()), rtol=0.05, atol=0.05)
    again = paratrain_model(j, seed=2)
    load_hf_into(again, tmp_path)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor.bfloat16().float())
    export_hf(j, model.state_dict(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


class ReadOnDemand(Mapping):
    """A model state read a tensor at a time, as checkpoint.CheckpointModel reads it: each read a fresh tensor,
    and the most alive at once counted (the exporter's peak, in tensors)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state, self.shapes, self.alive, self.most_alive = state, {k: v.shape for k, v in state.items()}, [], 0

    def __iter__(self):
        return iter(self.state)

    def __len__(self):
        return len(self.state)

    def __getitem__(self, name):
        tensor = self.state[name].clone()
        self.alive = [r for r in self.alive if r() is not None] + [weakref.ref(tensor)]
        self.most_alive = max(self.most_alive, len(self.alive))
        return tensor


def test_an_export_holds_one_shard_and_one_parameter_not_the_model(tmp_path):
    """Shards of 20 KB in fp32 (the tiny Llama is 86 KB): each shard is written as soon as its tensors are read,
    so at no time are more of the model's tensors alive than a shard holds and the one being read; the files are
    those of the whole model exported at once."""
    j = job("llama")
    state = paratrain_model(j).state_dict()
    lazy = ReadOnDemand(state)
    export_hf(j, lazy, tmp_path / "lazy", max_shard_bytes=20_000)
    export_hf(j, state, tmp_path / "whole", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "lazy").iterdir()) and len(files) > 4
    for name in files:
        assert (tmp_path / "lazy" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    largest_shard = max(sum(1 for _ in safe_open(tmp_path / "whole" / f, "pt").keys()) for f in files
                        if f.endswith(".safetensors"))
    assert lazy.most_alive <= largest_shard + 1 < len(state), (lazy.most_alive, largest_shard, len(state))


@pytest.mark.parametrize("family", MODELS)
def test_exported_special_token_ids_lie_in_the_vocabulary(family, tmp_path):
    """GPT-2's defaults name token 50256, which a character vocabulary lacks (transformers warned at every load of the
    kind walkthrough's Shakespeare model)."""
    j = job(family)
    export_hf(j, paratrain_model(j).state_dict(), tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    for token in (config.bos_token_id, config.eos_token_id):
        assert token is None or 0 <= token < VOCAB


def hf_random_model(family: str, directory):
    """A transformers model of MODELS[family]'s shape with its own random init, saved as a model directory."""
    m = MODELS[family]
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    else:
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_inner=48, n_layer=2, n_head=4,
                                         n_positions=m["blockSize"], activation_function="gelu",
                                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(5)
    hf = HF_CLASSES[family](config)
    hf.save_pretrained(directory)
    return hf.eval()


@pytest.mark.parametrize("family", MODELS)
def test_hf_weights_loaded_give_transformers_logits(family, tmp_path):
    hf_random_model(family, tmp_path)
    j = job(family, init=str(tmp_path))
    assert init_problem(j.spec.model, VOCAB) is None
    model = build_model(model_config(j.spec, VOCAB))
    load_hf_into(model, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens()), hf_logits(tmp_path), rtol=1e-4, atol=1e-5)  # logits ~0.4; observed ~1e-7


def test_gpt2_attention_biases_are_refused(tmp_path):
    hf = hf_random_model("gpt", tmp_path)
    with torch.no_grad():
        hf.transformer.h[0].attn.c_attn.bias.fill_(0.1)
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"spec.model.init: transformer.h.0.attn.c_attn.bias is not zero"):
        load_hf_into(build_model(model_config(job("gpt").spec, VOCAB)), tmp_path)


def test_a_directory_of_another_shape_is_named(tmp_path):
    paratrain_model(job("llama"))
    export_hf(job("llama"), paratrain_model(job("llama")).state_dict(), tmp_path)
    problem = init_problem(job("llama", kvHeads=4, init=str(tmp_path)).spec.model, VOCAB)
    assert "num_key_value_heads is 2, the spec's 4" in problem, problem
    assert "not a Hugging Face model directory" in init_problem(job("llama", init=str(tmp_path / "x")).spec.model,
                                                                VOCAB)


def test_missing_init_directory_is_refused_before_launch(tmp_path):
    proc, _ = run_job(tmp_path, ["spec.model.family=llama", f"spec.model.init={tmp_path / 'nowhere'}"],
                      expect_ok=False)
    assert proc.returncode == 1 and "spec.model.init:" in proc.stderr and "nowhere" in proc.stderr, proc.stderr
    assert not (tmp_path / "work" / "logs").exists(), "no rank may start"


def test_tensor_parallel_and_zero3_runs_from_hf_weights_start_at_the_single_process_loss(tmp_path):
    """Every run's first loss is transformers' own loss of the HF model on the first step's batch: TP=2 loads shards,
    DeepSpeed ZeRO-3 one gathered parameter at a time into a model built partitioned."""
    hf = hf_random_model("llama", tmp_path / "hf")
    model = ["spec.model=" + "{" + ", ".join(f"{k}: {v}" for k, v in MODELS["llama"].items()) + "}",
             f"spec.model.init={tmp_path / 'hf'}"]
    _, single = run_job(tmp_path / "single", model + layout())
    _, tp2 = run_job(tmp_path / "tp2", model + layout(tensor=2))
    _, zero3 = run_job(tmp_path / "zero3", model + layout(data=2, zeroStage=3))
    assert_close_curves(tp2["losses"][:1], single["losses"][:1], rtol=1e-5)
    assert_close_curves(zero3["losses"][:1], single["losses"][:1], rtol=1e-5)
    spec = job("llama").spec
    corpus = load_corpus("synthetic", None, spec.data.val_fraction, VOCAB, spec.training.seed, 16)
    x, y = global_batch(corpus.train, spec.training.batch_size, 16, spec.training.seed, 0, TRAIN_STREAM)
    with torch.no_grad():
        expected = cross_entropy(hf(x).logits, y).item()
    assert_close_curves(single["losses"][:1], [expected], rtol=1e-5)


def test_paratrain_export_turns_a_tensor_parallel_checkpoint_into_a_transformers_model(token_dir, tmp_path):
    """The user's path: train a Llama on prepared tokens in a TP=2 layout, `paratrain export` its checkpoint, and
    transformers loads it with paratrain's logits and the data's tokenizer."""
    import subprocess
    import sys

    from tokenizers import Tokenizer

    from paratrain.train.checkpoint import full_model_state

    overrides = layout(tensor=2) + ["spec.model.family=llama", "spec.model.heads=4", "spec.model.kvHeads=2",
                                    "spec.data.source=tokens", f"spec.data.path={token_dir}",
                                    f"spec.checkpoint.path={tmp_path / 'ckpt'}", "spec.training.steps=2"]
    run_job(tmp_path, overrides)
    sets = [arg for o in overrides for arg in ("--set", o)]
    export = subprocess.run([sys.executable, "-m", "paratrain.cli", "export", str(tmp_path / "job.yaml"), *sets,
                             "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")],
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr
    assert "config.json, model.safetensors, tokenizer.json" in export.stdout
    # Which checkpoint, of which layout: the newest, step 2, of the TP=2 run.
    assert "paratrain export: step 2 (" in export.stdout and "step-00000002" in export.stdout, export.stdout
    assert "written by layout dp1·tp2·pp1" in export.stdout, export.stdout
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert len(set(modes.values())) == 1, modes  # safetensors' 0600 made like the rest

    trained = parse_job({**TINY_JOB, "spec": {**TINY_JOB["spec"], "model": {
        "family": "llama", "layers": 2, "heads": 4, "kvHeads": 2, "embedDim": 32, "blockSize": 16}}})
    state = full_model_state(tmp_path / "ckpt" / "step-00000002")
    model = build_model(model_config(trained.spec, state["tok_emb.weight"].shape[0]))
    model.load_state_dict(state)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    text = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).encode("To be, or not to be").ids
    with torch.no_grad():
        ids = torch.tensor([text])
        torch.testing.assert_close(hf(ids).logits, model.eval()(ids), rtol=1e-4, atol=1e-5)
    refused = subprocess.run([sys.executable, "-m", "paratrain.cli", "export", str(tmp_path / "job.yaml"), *sets,
                              "--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "hf2")],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "no complete checkpoint" in refused.stderr, refused.stderr
    sharded = subprocess.run([sys.executable, "-m", "paratrain.cli", "export", str(tmp_path / "job.yaml"), *sets,
                              "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"),
                              "--max-shard-size", "20KB", "--dtype", "bf16"], capture_output=True, text=True,
                             timeout=300)
    assert sharded.returncode == 0, sharded.stderr
    assert "model-00001-of-" in sharded.stdout and "model.safetensors.index.json" in sharded.stdout
    assert "model.safetensors," not in sharded.stdout  # the earlier single file replaced
    bad = subprocess.run([sys.executable, "-m", "paratrain.cli", "export", str(tmp_path / "job.yaml"), *sets,
                          "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf3"),
                          "--max-shard-size", "big"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "--max-shard-size" in bad.stderr, bad.stderr


@pytest.mark.parametrize("family", MODELS)
def test_a_sharded_checkpoint_loads_as_its_single_file_does(family, tmp_path):
    """Hugging Face's sharded layout (model-0000k-of-0000n.safetensors + model.safetensors.index.json), as
    `save_pretrained` writes every model over its shard size (all the 7B-class ones)."""
    hf = hf_random_model(family, tmp_path)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert not (sharded / "model.safetensors").exists() and len(list(sharded.glob("model-*.safetensors"))) > 2
    j = job(family, init=str(sharded))
    assert init_problem(j.spec.model, VOCAB) is None
    model = build_model(model_config(j.spec, VOCAB))
    load_hf_into(model, sharded)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens()), hf_logits(tmp_path), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config, problem", [
    ("[1, 2]", "holds a JSON list, not an object"),
    ('{"model_type": "llama", "rope_parameters": [1]}', "holds another model"),
    ("{", "cannot read"),
])
def test_a_malformed_config_is_named_not_a_crash(tmp_path, config, problem):
    export_hf(job("llama"), paratrain_model(job("llama")).state_dict(), tmp_path)
    (tmp_path / "config.json").write_text(config)
    assert problem in init_problem(job("llama", init=str(tmp_path)).spec.model, VOCAB)


def test_a_sharded_index_naming_a_file_elsewhere_is_refused(tmp_path):
    hf = hf_random_model("llama", tmp_path)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"model-00001', '"../model-00001'))
    problem = init_problem(job("llama", init=str(tmp_path / "sharded")).spec.model, VOCAB)
    assert "not a file in" in problem and "../model-00001" in problem


def test_export_replaces_a_link_in_its_output_never_writes_or_chmods_through_it(tmp_path):
    """A link planted where the export writes (config.json → a file of someone else's) is replaced, and the file it
    pointed at is neither written nor given the export's mode."""
    victim = tmp_path / "victim"
    victim.write_text("theirs")
    victim.chmod(0o600)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").symlink_to(victim)
    (out / "notes").symlink_to(victim)  # a link the export does not write: left alone, target untouched
    export_hf(job("llama"), paratrain_model(job("llama")).state_dict(), out)
    assert victim.read_text() == "theirs" and victim.stat().st_mode & 0o777 == 0o600
    assert not (out / "config.json").is_symlink() and json.loads((out / "config.json").read_text())


def test_an_export_that_fails_midway_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """Issue 44: the earlier export's weights were deleted before the new ones were written, so a failure midway
    (a full disk, a kill) left a directory of missing or mixed weights. Now the files are written aside and
    renamed in at the end; a killed export's leftovers are cleared by the next."""
    import safetensors.torch

    j = job("llama")
    out = tmp_path / "out"
    export_hf(j, paratrain_model(j, seed=1).state_dict(), out, max_shard_bytes=20_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len([n for n in before if n.startswith("model-")]) > 2
    (out / "README.md").write_text("mine")
    written = []
    save_file = safetensors.torch.save_file

    def full_disk(tensors, filename, metadata=None):
        if written:
            raise OSError(28, "No space left on device")
        written.append(filename)
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_hf(j, paratrain_model(j, seed=2).state_dict(), out, max_shard_bytes=20_000)  # its second shard
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "README.md"} == before
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    (out / ".paratrain-export-killed").mkdir()  # a killed export's staging directory
    export_hf(j, paratrain_model(j, seed=2).state_dict(), out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (out / "README.md").read_text() == "mine"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert len(list(f.keys())) > 0
