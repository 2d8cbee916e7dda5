"""Hand-made rates that the planner's tests price with: round numbers, not a machine's."""

from dorylus.plan.calibration import Rates

RATES = Rates(gather=((1e6, 2e9), (1e8, 1e9)), matmul_per_s=4e10, dropout_per_s=1e8, elementwise_per_s=2e9,
              softmax_per_s=1e8, attention_per_s=(3e8, 1e8))
