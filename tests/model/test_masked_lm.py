"""A masked language model's vocabulary head, loaded from each encoder family's
`…ForMaskedLM` checkpoint (its decoder tied to the word embeddings, saved once), scores
every vocabulary entry at every real token as transformers does, within 1e-5; a
checkpoint that holds no masked-LM head is refused when one is asked for."""

import pytest
import torch

from attnserve.model import CheckpointError, load_checkpoint
from tests.families import make_checkpoint

# XLM-RoBERTa and MPNet name their heads as RoBERTa does.
MASKED_LM_FAMILIES = ("bert", "roberta", "modernbert", "distilbert")


@pytest.mark.parametrize("family", MASKED_LM_FAMILIES)
def test_vocabulary_scores_match_transformers(tmp_path, family):
    import transformers

    checkpoint = make_checkpoint(family, tmp_path / family)
    torch.manual_seed(0)
    reference = transformers.AutoModelForMaskedLM.from_config(
        transformers.AutoConfig.from_pretrained(checkpoint)).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # biases and norms off their defaults, so a misplaced one shows
        for parameter in reference.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.2)
    reference.save_pretrained(checkpoint)
    ours = load_checkpoint(checkpoint, keep_language_model_head=True).eval()
    ids = torch.randint(5, reference.config.vocab_size - 5, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, mask)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=0)


def test_a_base_model_has_no_masked_lm_head_to_keep(tmp_path):
    checkpoint = make_checkpoint("distilbert", tmp_path / "base")
    with pytest.raises(CheckpointError, match="the masked-LM head's scores are asked for, but its "
                                              "architectures hold no DistilBertForMaskedLM"):
        load_checkpoint(checkpoint, keep_language_model_head=True)
