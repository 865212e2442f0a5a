"""Evidence, apart from the product: benchmarks (`openrlhf-oppo bench`) and plots
(`openrlhf-oppo plot`). The product's packages never import this one."""
