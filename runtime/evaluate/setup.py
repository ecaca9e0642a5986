"""The evaluation's door: the resolved recipe read once, each part handed its own settings.

:func:`eval_setup` is the one place the evaluation's entries (``python3 -m runtime.evaluate`` and
``python3 -m runtime.evaluate.during_training``) turn the recipe into the parts' settings: the
target, the draft's spec, the eval sets (paths resolved), the stop tokens, the route, the
teacher-forced ``tau``'s layout and the SGLang route's server. Everything below takes these
frozen parts (:mod:`runtime.evaluate.settings`), never the recipe.
"""

from __future__ import annotations

from collections.abc import Collection

from runtime.capture.setup import sglang_server_settings
from runtime.evaluate.settings import EvalSetFile, EvalSettings, EvalSetup, TargetSettings, TeacherForcing
from runtime.recipe.loader import ResolvedRecipe
from runtime.recipe.schema import EvalSection
from runtime.trainer.draft_spec import DraftSpec


def eval_setup(resolved: ResolvedRecipe, section: EvalSection, set_names: Collection[str] | None = None) -> EvalSetup:
    """The evaluation's settings: ``section`` (the eval section to run) over the job of ``resolved``;
    only the eval sets named in ``set_names`` (None: all)."""
    recipe = resolved.recipe
    capture = recipe.capture
    trainer = recipe.trainer
    return EvalSetup(
        job_dir=resolved.job_dir,
        recipe_file=resolved.path,
        recipe_digest=resolved.digest,
        checkpoint_dir=resolved.checkpoint_dir(),
        target=TargetSettings(
            path=resolved.resolve_path(capture.target_path),
            compute_dtype=capture.compute_dtype,
            aux_layer_ids=tuple(capture.aux_layer_ids),
            vocab_size=capture.vocab_size,
            hidden_size=capture.hidden_size,
            embed_tensor_name=trainer.embed_tensor_name,
            lm_head_tensor_name=trainer.lm_head_tensor_name,
        ),
        draft=DraftSpec.from_recipe(recipe),
        eval=EvalSettings(
            sets=tuple(
                EvalSetFile(s.name, i, resolved.resolve_path(s.path), s.sha256, s.max_prompts)
                for i, s in enumerate(section.sets)
                if set_names is None or s.name in set_names
            ),
            max_new_tokens=section.max_new_tokens,
            temperatures=tuple(section.temperatures),
            stop_ids=frozenset({capture.special_tokens.eos_id, *section.stop_token_ids}),
            batch_size=section.batch_size,
            seed=section.seed,
            device=section.device,
            compare_untrained=section.compare_untrained,
            route=capture.engine if section.route == "auto" else section.route,
            sglang_verify_mode=section.sglang_verify_mode,
            request_timeout_s=section.request_timeout_s,
            checkpoint_prompts=section.checkpoint_prompts,
        ),
        teacher_forcing=TeacherForcing(
            loss_decay_gamma=trainer.loss.loss_decay_gamma,
            chunk_blocks=max(1, trainer.loss.objective_chunk_blocks),
            anchor_seed=trainer.seed,
        ),
        sglang=sglang_server_settings(resolved),
    )
