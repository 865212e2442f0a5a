"""Evidence, apart from the product: benchmarks (`openrlhf-oppo bench`), plots
(`openrlhf-oppo plot`) and a synthetic rollout engine (`synthetic`) the simulator shares.
The product's packages never import this one."""
