"""The loader as it was before the token store (main at 9ef6987, dflash_core/data/tokenize.py):
records rendered and tokenised one by one into LongTensor samples. The store's tests compare
against it sample for sample and micro-batch for micro-batch."""
import torch

from dflash_core.data.records import dataset_sources, read_records
from dflash_core.data.render import ChatRenderer


def reference_samples(paths, tokenizer, *, max_length, last_turn_only=False, chat_template_kwargs=None):
    samples = []
    for path in dataset_sources(paths):
        renderer = None
        for _, record in read_records(path):
            if record.text is not None:
                text, spans = record.text, None
            else:
                renderer = renderer or ChatRenderer(tokenizer, chat_template_kwargs)
                text, spans = renderer.conversation(record, last_turn_only)
            encoded = tokenizer([text], add_special_tokens=False, return_offsets_mapping=True)
            ids = torch.tensor(encoded["input_ids"][0], dtype=torch.long)
            offsets = torch.tensor(encoded["offset_mapping"][0], dtype=torch.long).reshape(-1, 2)
            if spans is None:
                mask = torch.ones(len(offsets), dtype=torch.long)
            else:
                hit = torch.zeros(len(offsets), dtype=torch.bool)
                for start, end in spans:
                    hit |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
                mask = hit.long()
            ids, mask = ids[:max_length], mask[:max_length]
            if bool((mask[:-1] & mask[1:]).any()):
                samples.append({"input_ids": ids, "loss_mask": mask})
    return samples
