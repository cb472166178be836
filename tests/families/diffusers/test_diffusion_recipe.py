"""Diffusion distillation (`distill_diffusion`): recipe schema, noise schedule, losses, latents, a run, its resume."""

from __future__ import annotations

import copy
import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install -e '.[diffusers]')")

from safetensors.torch import load_file, save_file  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tests.support.paths import RECIPES  # noqa: E402
from vca_patch import VCAConfig, patch_model  # noqa: E402
from vca_patch.checkpoint import save_pretrained  # noqa: E402
from vca_patch.data import DatasetError  # noqa: E402
from vca_patch.train import RecipeError, StageSpec, finetune, load_recipe, recipe_from_dict  # noqa: E402
from vca_patch.train.diffusion import NoiseSchedule, distill_diffusion_loss, evaluate_diffusion, predict  # noqa: E402
from vca_patch.train.diffusion_data import LatentFolder, latent_datasets  # noqa: E402
from vca_patch.train.diffusion_spec import DiffusionSpec  # noqa: E402
from vca_patch.train.finetune import teacher_from  # noqa: E402
from vca_patch.train.objective import RecoveryObjective  # noqa: E402
from vca_patch.train.optim import stage_optimizer  # noqa: E402

RECIPES = RECIPES


def tiny_dit() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, sample_size=16,
        patch_size=2, num_embeds_ada_norm=10,
    ).eval()  # fmt: skip


def patched_dit() -> torch.nn.Module:
    model = tiny_dit()
    patch_model(model, VCAConfig())
    return model


def short_recipe(**diffusion) -> dict:
    """The CPU recipe, shortened: 24 steps of 8 latents, checkpoints every 8."""
    import yaml

    data = yaml.safe_load((RECIPES / "dit_tiny_cpu.yaml").read_text())
    data["diffusion"].update(train_latents=64, eval_latents=8, **diffusion)
    data["train"].update(checkpoint_every=8, eval_every=12, eval_images=8, log_every=100)
    data["stages"][0].update(steps=24, warmup_steps=2)
    return data


# -- schema ---------------------------------------------------------------------------------------------------


def test_shipped_recipes_validate():
    gpu, cpu = load_recipe(RECIPES / "dit_xl_2_256.yaml"), load_recipe(RECIPES / "dit_tiny_cpu.yaml")
    assert gpu.diffusion.prediction == "epsilon" and gpu.train.mixed_precision == "bf16" and "H100" in gpu.budget
    assert cpu.stages[0].kind == "distill_diffusion" and cpu.diffusion.timestep_weighting == "min_snr"
    assert cpu.stages[0].carried_lr < cpu.stages[0].lr  # q/k/v/out at a lower rate


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.pop("diffusion"), "needs a `diffusion` section"),
        (lambda d: d["stages"].append({"name": "t", "kind": "attention_transfer", "steps": 1}), "takes distill_diff"),
        (lambda d: d["diffusion"].update(prediction="flow"), "'min_snr' is for epsilon"),
        (lambda d: d["diffusion"].update(timestep_weighting="sqrt"), "timestep_weighting: expected one of"),
        (lambda d: d["diffusion"].update(attention_weight=0, teacher_weight=0, objective_weight=0), "nothing to"),
        (lambda d: d["diffusion"].update(latent=3), "unknown key 'latent'"),
    ],
)
def test_invalid_diffusion_recipes_name_the_key(edit, message):
    data = short_recipe()
    edit(data)
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(data)


# -- noise schedule and losses --------------------------------------------------------------------------------


def test_epsilon_schedule_matches_a_float64_ddpm_reference():
    spec = DiffusionSpec(timestep_weighting="min_snr", min_snr_gamma=5.0)
    schedule = NoiseSchedule(tiny_dit(), spec)
    x0 = torch.randn(64, 4, 8, 8, dtype=torch.float64)
    torch.manual_seed(3)
    x_t, t, target, weight = schedule.draw(x0)
    torch.manual_seed(3)  # the same draws: u, then the noise
    u = torch.rand(64)
    noise = torch.randn(x0.shape, dtype=torch.float32).double()
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    ab = torch.cumprod(1 - betas, 0)[(u.double() * 1000).long()]
    expected = ab.sqrt().view(-1, 1, 1, 1) * x0 + (1 - ab).sqrt().view(-1, 1, 1, 1) * noise
    assert torch.equal(t, (u.double() * 1000).long()) and torch.equal(target, noise)
    assert (x_t - expected).abs().max() < 1e-6  # float32 betas; measured 3e-8
    snr = ab / (1 - ab)
    assert torch.allclose(weight.double(), torch.minimum(snr, torch.tensor(5.0)) / snr, rtol=1e-5)
    assert weight.min() < 0.5 and weight.max() == 1.0  # low-noise steps down-weighted, high-noise ones not


def test_flow_schedule_interpolates_and_targets_the_velocity():
    sd3 = diffusers.SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=12, out_channels=4,
        pos_embed_max_size=16,
    )  # fmt: skip
    schedule = NoiseSchedule(sd3, DiffusionSpec(flow_shift=3.0, timestep_sampling="logit_normal"))
    x0 = torch.randn(32, 4, 8, 8, dtype=torch.float64)
    torch.manual_seed(5)
    x_t, t, target, _ = schedule.draw(x0)
    torch.manual_seed(5)
    u = torch.sigmoid(torch.normal(0.0, 1.0, (32,))).double()
    noise = torch.randn(x0.shape, dtype=torch.float32).double()
    sigma = 3 * u / (1 + 2 * u)
    s = sigma.view(-1, 1, 1, 1)
    assert torch.allclose(x_t, (1 - s) * x0 + s * noise, atol=1e-12)
    assert torch.allclose(target, noise - x0) and torch.allclose(t, sigma * 1000)  # SD3 takes σ·1000


def test_loss_is_the_weighted_sum_of_its_three_terms_against_a_written_out_reference():
    student = patched_dit().train()
    teacher = teacher_from(student)
    weights = {"attention_weight": 0.7, "teacher_weight": 0.3, "objective_weight": 2.0}
    spec = DiffusionSpec(train_latents=4, eval_latents=4, **weights)
    x0, cond = next(iter(DataLoader(latent_datasets(student, spec)[0], batch_size=4)))
    objective = RecoveryObjective(student, teacher, StageSpec("s", "distill_diffusion", 1), None, spec)
    torch.manual_seed(11)
    loss = distill_diffusion_loss(objective, x0, cond)

    torch.manual_seed(11)
    x_t, t, target, weight = NoiseSchedule(student, spec).draw(x0)
    outs: dict[str, list[torch.Tensor]] = {"s": [], "t": []}
    paths = ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"]
    for key, model in (("s", student), ("t", teacher)):
        hooks = [model.get_submodule(p).register_forward_hook(lambda m, a, o, k=key: outs[k].append(o)) for p in paths]
        with torch.no_grad():
            pred = predict(model, x_t, t, cond)
        outs[key + "pred"] = pred
        for h in hooks:
            h.remove()
    s_pred, t_pred = outs.pop("spred").double(), outs.pop("tpred").double()
    w = weight.double()
    objective_term = (w * (s_pred[:, :4] - target.double()).pow(2).mean((1, 2, 3))).mean()
    teacher_term = (w * (s_pred - t_pred).pow(2).mean((1, 2, 3))).mean()
    attention_term = sum(
        (w * (s.double() - r.double()).pow(2).sum((1, 2))).sum() / r.double().pow(2).sum()
        for s, r in zip(outs["s"], outs["t"], strict=True)
    ) / len(paths)
    expected = 2.0 * objective_term + 0.3 * teacher_term + 0.7 * attention_term
    assert attention_term > 1e-3 and teacher_term > 1e-4  # conversion changed both
    assert abs(float(loss.detach()) - float(expected)) < 1e-6 * float(expected)  # float32 model; measured 6e-8
    loss.backward()
    attn = student.transformer_blocks[0].attn1
    assert attn.vca.contrast_embed_pos.grad.abs().sum() > 0 and attn.to_q.weight.grad.abs().sum() > 0


def test_optimizer_trains_vca_parameters_and_qkv_out_at_the_lower_rate():
    student = patched_dit()
    stage = StageSpec("s", "distill_diffusion", 1, lr=1e-3, carried_lr=1e-4, options={"lambda_lr": 1e-4})
    groups = {g["group"]: g for g in stage_optimizer(student, stage).param_groups}
    names = {id(p): n for n, p in student.named_parameters()}
    carried = sorted(names[id(p)] for p in groups["carried"]["params"])
    assert carried == sorted(
        f"transformer_blocks.{i}.attn1.{m}.{w}"
        for i in (0, 1) for m in ("to_q", "to_k", "to_v", "to_out.0") for w in ("weight", "bias")
    )  # fmt: skip
    assert all(".attn1.vca." in names[id(p)] for p in groups["new"]["params"] + groups["lambda"]["params"])
    assert all("lambda" in names[id(p)] for p in groups["lambda"]["params"]) and groups["lambda"]["params"]
    assert groups["carried"]["lr_scale"] == pytest.approx(0.1) and "rest" not in groups
    assert not student.pos_embed.proj.weight.requires_grad  # outside attention: frozen

    from vca_patch.targets.vca.training import guard_lambdas, lambda_trace

    lam = student.transformer_blocks[1].attn1.vca.lambda2  # the processor's layer holds these very modules
    with torch.no_grad():
        lam.q1.add_(lam.k1 / lam.k1.norm() ** 2 * 3.0)  # exp⟨q1, k1⟩ grows by e³: λ₂ far above 0.95
    assert len(lambda_trace(student)) == 2 and lambda_trace(student)[1][1] > 0.95
    assert guard_lambdas(student, 0.95) == 1 and float(lam().detach()) == pytest.approx(0.95, abs=1e-5)


# -- latents ----------------------------------------------------------------------------------------------------


def test_latent_folder_reads_pt_and_safetensors_with_their_labels(tmp_path):
    model = tiny_dit()
    torch.save({"latents": torch.randn(3, 4, 16, 16), "class_labels": torch.tensor([1, 2, 3])}, tmp_path / "a.pt")
    save_file({"latents": torch.randn(4, 16, 16)}, str(tmp_path / "b.safetensors"))
    spec = DiffusionSpec(latents=str(tmp_path), train_latents=3, eval_latents=1)
    train, held_out = latent_datasets(model, spec)
    assert (len(train), len(held_out)) == (3, 1)
    assert [int(train[i][1]["class_labels"]) for i in range(3)] == [1, 2, 3]
    stored = load_file(str(tmp_path / "b.safetensors"))["latents"]
    assert torch.equal(held_out[0][0], stored) and 0 <= int(held_out[0][1]["class_labels"]) < 10  # drawn

    torch.save(torch.randn(3, 16, 16), tmp_path / "c.pt")
    with pytest.raises(DatasetError, match=r"c.pt: latents of shape \(3, 16, 16\).*takes \[4, H, W\]"):
        LatentFolder(model, spec, tmp_path)
    with pytest.raises(DatasetError, match="not a folder"):
        LatentFolder(model, spec, tmp_path / "missing")


def test_generated_latents_are_deterministic_and_disjoint_between_splits():
    spec = DiffusionSpec(train_latents=4, eval_latents=4)
    train, held_out = latent_datasets(tiny_dit(), spec)
    assert torch.equal(train[2][0], train[2][0]) and not torch.equal(train[0][0], held_out[0][0])
    assert train[0][0].shape == (4, 16, 16) and train[0][1]["class_labels"].dtype == torch.int64


# -- a run and its resume ---------------------------------------------------------------------------------------


def test_finetune_lowers_the_distillation_error_and_resume_replays_the_run(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from vca_patch.cli.app import app

    save_pretrained(patched_dit(), tmp_path / "converted")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(short_recipe()))

    result = CliRunner().invoke(
        app, ["finetune", str(tmp_path / "converted"), "--recipe", str(recipe), "-o", str(tmp_path / "a"),
              "--device", "cpu"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    before, final = metrics["before"], metrics["final"]
    assert metrics["status"] == "completed" and [e["step"] for e in metrics["evaluations"]] == [12, 24]
    # measured: prediction error 0.081 -> 0.044, mean teacher-forced layer error 0.82 -> 0.38
    assert final["prediction_error"] < 0.7 * before["prediction_error"]
    assert final["mean_layer_error"] < before["mean_layer_error"]
    assert metrics["evaluations"][1]["loss"] < metrics["evaluations"][0]["loss"]

    out_b = tmp_path / "b"
    first = finetune(tmp_path / "converted", recipe, out_b, device="cpu", stop_after_steps=12)
    assert not first.completed and (out_b / "checkpoints" / "step_0000008").is_dir()
    resumed = finetune(tmp_path / "converted", recipe, out_b, device="cpu", resume=True)
    assert resumed.completed and resumed.metrics["resumed_from"] == 8
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(out_b / "model.safetensors"))
    assert a.keys() == b.keys() and any(".attn1.vca." in k for k in a)
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key  # measured: bit-identical
    assert resumed.metrics["final"]["prediction_error"] == pytest.approx(final["prediction_error"], rel=1e-5)


def test_evaluation_measures_the_conversion_with_fixed_draws():
    """Against the unpatched model, on noise and timesteps fixed by the spec's seed (the same at every evaluation)."""
    student = patched_dit()
    teacher = teacher_from(student)
    spec = DiffusionSpec(train_latents=2, eval_latents=4)
    held_out = latent_datasets(student, spec)[1]
    report = evaluate_diffusion(student, teacher, held_out, 4, spec)
    assert report["layers"] == ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"]
    assert report["prediction_error"] > 1e-3 and min(report["layer_error"]) > 1e-3
    assert report["layer_error"][0] == pytest.approx(report["layer_error_free"][0])  # block 0 sees the same input
    assert report["objective_teacher"] > 0 and report["latents"] == 4
    again = evaluate_diffusion(student, copy.deepcopy(teacher), held_out, 4, spec)
    assert again == report


def test_fidelity_cli_reports_layer_and_prediction_errors_of_a_diffusion_checkpoint(tmp_path):
    from typer.testing import CliRunner

    from vca_patch.cli.app import app
    from vca_patch.eval.fidelity import diffusion_fidelity

    model = patched_dit()
    save_pretrained(model, tmp_path / "converted")
    data = tmp_path / "latents"  # a folder apart: outputs may not be written inside an input folder
    data.mkdir()
    torch.save({"latents": torch.randn(6, 4, 16, 16), "class_labels": torch.arange(6)}, data / "latents.pt")
    args = [
        "fidelity",
        str(tmp_path / "converted"),
        "--limit",
        "6",
        "--device",
        "cpu",
        "--json",
        str(tmp_path / "f.json"),
    ]
    result = CliRunner().invoke(app, [*args, "--data", str(data)])
    assert result.exit_code == 0, result.output
    assert "transformer_blocks.1.attn1" in result.output and "prediction_error" in result.output.replace(" ", "_")
    report = json.loads((tmp_path / "f.json").read_text())
    direct = diffusion_fidelity(None, model, latents=data, count=6)
    assert report["latents"] == 6 and report["prediction"] == "epsilon"
    assert report["prediction_error"] == pytest.approx(direct["prediction_error"], rel=1e-6)  # the same draws
    assert report["layer_error"] == pytest.approx(direct["layer_error"], rel=1e-6)
    assert 0.01 < report["prediction_error"] < 1.0  # conversion alone: measured 0.10 on this tiny DiT

    torch.save(torch.randn(2, 3, 16, 16), data / "bad.pt")
    result = CliRunner().invoke(app, [*args, "--data", str(data), "--force"])  # --json f.json exists now
    assert result.exit_code == 2 and "bad.pt" in result.output
