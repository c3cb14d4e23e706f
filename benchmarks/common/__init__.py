"""What the benchmarks share: the device, timing, byte models, the optimizers under
test and ivon-opt, the reads of private attributes, and the CSV / JSON / markdown output."""
