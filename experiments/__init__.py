"""Load generation and disaggregation experiments: `splitserve bench` and `splitserve experiment`."""
