"""Reference numbers from the project's independent reference scripts (outside this library),
published with their provenance in docs/privacy/reference_numbers.md#reference-numbers and
docs/privacy/envelope.md#envelope-law.

Provenance:

* ENVELOPE_CDF, S_ENV (docs/privacy/envelope.md#envelope-law): numerical values from scipy's
  chi-square functions and the closed-form Chernoff bound. Values are printed to the digits kept
  here; tests compare to half a unit in the last printed digit.
* S_MAX (docs/privacy/prv.md#prv-quadrature): ``s_max = sqrt(k / F^{-1}_{chi2_k}(eta))`` at ``eta =
  1e-15``.
* EPS_T100, EPS_T1000, K_CONVERGENCE, CHERNOFF_COSTS
  (docs/privacy/reference_numbers.md#reference-epsilon, docs/privacy/envelope.md#envelope-costs):
  epsilon at ``delta = 1e-5``, ``q = 0.01``, computed by an independent reference script
  (prv-accountant 0.2.0 composition of the PRVs of docs/privacy/prv.md#prv: eps_error = 0.01,
  delta_error = delta / 1000, envelope "chi2", eta = 1e-15, t_cap rule 1e-3 delta), each value
  the max over directions of the prv_accountant *estimate*, cross-checked against a uniform-grid
  PLD bracket at the bracket midpoints. Stated precision: +-0.02 absolute, +-1% for values >= 10.
* OPACUS_PRV_UPPER (docs/privacy/reference_numbers.md#reference-epsilon): Opacus 1.6
  ``PRVAccountant.get_epsilon`` (upper bound, eps_error 0.01).
* SIGMA_FOR_EPS (docs/privacy/reference_numbers.md#reference-sigma): noise multiplier with
  remove-direction estimate = target (to +-0.002 in epsilon); stated precision +-0.003 in sigma,
  test tolerance 1% relative.
* PRV_TAIL_MC (docs/privacy/reference_numbers.md#reference-tail): P(Y_R > t) for k = 32, sigma = 1,
  q = 0.01 from the PRV, with a 4e8-draw Monte Carlo check.
"""

# k -> {y: (chi2 envelope P(chi2_k <= k y), chernoff envelope (y e^{1-y})^{k/2})}
ENVELOPE_CDF = {
    8: {
        0.25: ("1.8988157e-2", "7.846e-2"),
        0.5: ("1.4287654e-1", "4.618e-1"),
        0.75: ("3.5276811e-1", "8.601e-1"),
        0.9: ("4.8478389e-1", "9.788e-1"),
        0.99: ("5.5867640e-1", "9.998e-1"),
    },
    16: {
        0.25: ("1.0967190e-3", "6.156e-3"),
        0.5: ("5.1133616e-2", "2.133e-1"),
        0.75: ("2.5602024e-1", "7.397e-1"),
        0.9: ("4.3105876e-1", "9.580e-1"),
        0.99: ("5.3581757e-1", "9.996e-1"),
    },
    32: {
        0.25: ("4.8926107e-6", "3.789e-5"),
        0.5: ("8.2310110e-3", "4.549e-2"),
        0.75: ("1.5558435e-1", "5.472e-1"),
        0.9: ("3.7069887e-1", "9.178e-1"),
        0.99: ("5.1730468e-1", "9.992e-1"),
    },
    64: {
        0.25: ("1.3294482e-10", "1.436e-9"),
        0.5: ("2.7619980e-4", "2.069e-3"),
        0.75: ("6.7764389e-2", "2.994e-1"),
        0.9: ("2.9935729e-1", "8.424e-1"),
        0.99: ("5.0090165e-1", "9.984e-1"),
    },
}

# k -> (P(S=1), E S, median, q0.9, q0.99, q(1-1e-6), q(1-1e-10)), S in units of C (chi2 envelope)
S_ENV = {
    8: (
        "0.4334701204",
        "1.1728116875",
        "1.043699",
        "1.514122",
        "2.204268",
        "7.506268",
        "23.889069",
    ),
    16: (
        "0.4529608095",
        "1.1018931802",
        "1.021336",
        "1.310790",
        "1.659164",
        "3.321025",
        "6.073996",
    ),
    32: (
        "0.4667448914",
        "1.0641309777",
        "1.010542",
        "1.198696",
        "1.398473",
        "2.130958",
        "2.988692",
    ),
    64: (
        "0.4764883055",
        "1.0419653656",
        "1.005239",
        "1.131413",
        "1.254779",
        "1.641643",
        "2.011726",
    ),
}
S_ENV_LEVELS = ("atom", "mean", 0.5, 0.9, 0.99, 1 - 1e-6, 1 - 1e-10)

S_MAX = {8: "100.8", 16: "12.59", 32: "4.406", 64: "2.513"}

# sigma -> k -> (hidden, revealed, add-direction epsilon in hidden mode); k=None: (exact, exact,
# add)
EPS_T100 = {
    0.8: {
        None: (1.511, 1.511, 0.437),
        8: (13.536, 22.578, 0.517),
        16: (2.747, 5.623, 0.485),
        32: (2.028, 2.830, 0.468),
        64: (1.796, 2.052, 0.457),
    },
    1.0: {
        None: (0.718, 0.718, 0.338),
        8: (5.524, 13.597, 0.403),
        16: (1.188, 2.893, 0.378),
        32: (0.923, 1.291, 0.363),
        64: (0.833, 0.932, 0.354),
    },
    1.5: {
        None: (0.292, 0.292, 0.213),
        8: (0.546, 4.578, 0.255),
        16: (0.357, 0.588, 0.238),
        32: (0.328, 0.353, 0.229),
        64: (0.314, 0.321, 0.224),
    },
}
EPS_T1000 = {
    0.8: {
        None: (3.141, 3.141, 1.983),
        8: (30.675, 42.976, 2.609),
        16: (4.896, 9.134, 2.335),
        32: (3.919, 4.853, 2.197),
        64: (3.586, 3.838, 2.120),
    },
    1.0: {
        None: (1.828, 1.828, 1.417),
        8: (14.998, 26.584, 1.834),
        16: (2.469, 5.149, 1.647),
        32: (2.140, 2.522, 1.556),
        64: (2.013, 2.090, 1.506),
    },
    1.5: {
        None: (0.918, 0.918, 0.822),
        8: (1.628, 10.477, 1.023),
        16: (1.074, 1.396, 0.934),
        32: (1.010, 1.032, 0.891),
        64: (0.976, 0.983, 0.867),
    },
}
EPS_TABLES = {100: EPS_T100, 1000: EPS_T1000}

# The independent PLD check of docs/privacy/reference_numbers.md#reference-epsilon (T = 1000, sigma
# = 1): prv_accountant estimates (remove, add)
ESTIMATES_T1000_SIGMA1 = {
    None: (1.8282, 1.4167),
    (32, "hidden"): (2.1399, 1.5563),
    (32, "revealed"): (2.5220, 1.5644),
}

# T = 1000, sigma = 1, hidden, remove direction; k = None is exact clipping
K_CONVERGENCE = {
    32: 2.140,
    64: 2.013,
    128: 1.946,
    256: 1.906,
    1024: 1.864,
    4096: 1.846,
    None: 1.828,
}

# (T, sigma, k) -> (exact, chi2, chernoff), hidden, max over directions
# (docs/privacy/envelope.md#envelope-costs)
CHERNOFF_COSTS = {
    (1000, 1.0, 32): (1.828, 2.140, 2.845),
    (1000, 1.0, 64): (1.828, 2.013, 2.421),
    (100, 1.5, 32): (0.292, 0.328, 0.408),
}

# Opacus PRVAccountant.get_epsilon (upper) at q = 0.01, delta = 1e-5: (T, sigma) -> epsilon
OPACUS_PRV_UPPER = {
    (100, 0.8): 1.5211,
    (100, 1.0): 0.7281,
    (100, 1.5): 0.3022,
    (1000, 0.8): 3.1513,
    (1000, 1.0): 1.8384,
    (1000, 1.5): 0.9276,
}

# (T, target epsilon) -> (sigma exact, sigma k=32 hidden, sigma k=32 revealed, eps_add at hidden)
SIGMA_FOR_EPS = {
    (100, 1): (0.9021, 0.9776, 1.0704, 0.373),
    (100, 3): (0.6496, 0.7107, 0.7855, 0.533),
    (100, 8): (0.4645, 0.5094, 0.5477, 3.007),
    (1000, 1): (1.4146, 1.5097, 1.5302, 0.884),
    (1000, 3): (0.8136, 0.8775, 0.9430, 1.898),
    (1000, 8): (0.5863, 0.6358, 0.6715, 3.209),
}

# t -> (P(Y_R > t) from the PRV, Monte Carlo estimate, its standard error); k=32, sigma=1, q=0.01
PRV_TAIL_MC = {
    0.0: (3.0047e-1, 3.0044e-1, 2.3e-5),
    0.5: (9.2388e-6, 9.2250e-6, 1.5e-7),
    1.0: (1.9858e-7, 1.950e-7, 2.2e-8),
}
