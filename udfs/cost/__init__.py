"""What a call costs and paying for it once: prices, the spend budget, the result cache and single-flight."""
