"""Load generation and disaggregation experiments: `splitserve bench` and `splitserve experiment`
(example configs in configs/); benchmarks/ builds and sends its requests with the same modules."""
