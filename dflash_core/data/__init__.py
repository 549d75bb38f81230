"""Chat data: local files -> tokenised samples with assistant loss masks -> micro-batches."""

from .batches import MicroBatch, MicroBatchSource
from .records import (
           DataError,
           Record,
           dataset_sources,
           file_digest,
           normalise_record,
           read_records,
)
from .render import ChatRenderer
from .tokenize import describe_drops, drop_warning, load_samples, load_tokenizer

__all__ = ["ChatRenderer", "DataError", "MicroBatch", "MicroBatchSource", "Record", "dataset_sources",
           "describe_drops", "drop_warning", "file_digest", "load_samples", "load_tokenizer", "normalise_record",
           "read_records"]
