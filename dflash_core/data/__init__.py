"""Chat data: local files -> tokenised samples with assistant loss masks -> micro-batches."""

from .batches import MicroBatch, MicroBatchSource
from .records import DataError, Record, file_digest, normalise_record, read_records
from .tokenize import load_samples

__all__ = ["DataError", "MicroBatch", "MicroBatchSource", "Record", "file_digest", "load_samples",
           "normalise_record", "read_records"]
