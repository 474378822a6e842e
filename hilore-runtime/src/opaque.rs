//! Opaque recovery units: unmodified candle closures and zoo modules managed as units.
