//! Loading candle-zoo / Hugging Face checkpoints and exporting them back.
