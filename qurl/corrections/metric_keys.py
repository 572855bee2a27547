"""The objective's metric names and how each combines over micro-batches and ranks; torch-free, so that the run's
output contract (qurl/outputs/metrics.py) can list them without importing torch."""

ACR_UPPER_LOG_THRESHOLD = 100.0  # acr/upper_over_100_frac counts bounds above this (no cap is applied)
IS_MEAN, IS_STD, ESS = (
    "rollout_corr/rollout_is_mean",
    "rollout_corr/rollout_is_std",
    "rollout_corr/rollout_is_eff_sample_size",
)
# key -> how it combines: token (mean over response tokens), seq (mean over rows with a response token), max, min,
# std (of the IS weight over tokens), derived (from the others after combining)
REDUCE: dict[str, str] = {
    "actor/clipfrac": "token",
    "actor/dual_clipfrac": "token",
    "tis/truncated_frac": "token",
    "acr/widened_frac": "token",
    "acr/upper_max": "max",
    "acr/upper_over_100_frac": "token",
    "mismatch/kl_k1": "token",
    "mismatch/kl_k3": "token",
    "mismatch/rho_max": "max",
    "rollout_corr/kl": "token",
    "rollout_corr/k3_kl": "token",
    "rollout_corr/training_ppl": "seq",
    "rollout_corr/rollout_ppl": "seq",
    "rollout_corr/ppl_ratio": "seq",
    "rollout_corr/log_ppl_diff": "seq",
    "rollout_corr/log_ppl_abs_diff": "seq",
    "rollout_corr/log_ppl_diff_max": "max",
    "rollout_corr/log_ppl_diff_min": "min",
    "rollout_corr/chi2_token": "token",
    "rollout_corr/chi2_seq": "seq",
    IS_MEAN: "token",
    IS_STD: "std",
    "rollout_corr/rollout_is_min": "min",
    "rollout_corr/rollout_is_max": "max",
    ESS: "derived",
    "rollout_corr/rollout_is_ratio_fraction_high": "token",
    "rollout_corr/rollout_rs_masked_fraction": "token",
    "rollout_corr/rollout_rs_seq_masked_fraction": "seq",
}
