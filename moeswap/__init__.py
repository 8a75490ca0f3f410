"""moeswap: run Mixture-of-Experts models on machines whose fast memory cannot hold them."""
