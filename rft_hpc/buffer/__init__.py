"""The HDF5 experience buffer shared by explorers and the trainer (docs/buffer-format.md)."""

from rft_hpc.buffer.reader import Batch, BufferReader, RecordRef
from rft_hpc.buffer.records import DPOPair, Experience, Record, SFTSample
from rft_hpc.buffer.segment import SCHEMA_VERSION, CorruptSegment, read_segment
from rft_hpc.buffer.writer import SegmentWriter
from rft_hpc.config.buffer import BufferConfig

__all__ = [
    "SCHEMA_VERSION", "Batch", "BufferConfig", "BufferReader", "CorruptSegment", "DPOPair",
    "Experience", "Record", "RecordRef", "SFTSample", "SegmentWriter", "read_segment",
]
