//! The eight training methods and their names.

use std::fmt;
use std::str::FromStr;

/// An optimizer name that is none of [`Method::ALL`]'s (the offending text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownMethod(pub String);

impl fmt::Display for UnknownMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown optimizer {:?}: expected a comma-separated list of ring, reng, ngd, rkalman, kalman, adamw, sgd, sophia (or all)",
            self.0
        )
    }
}

impl std::error::Error for UnknownMethod {}

/// A training method: one of the paper's optimizers or a baseline (docs/math.md §2–4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Method {
    /// RING: K-FAC with norm-scaled damping `√ρ‖·‖₂` (docs/math.md §2).
    Ring,
    /// RENG: K-FAC with damping `√ρ` on the gradient of `L + c‖∇L‖²` (docs/math.md §2).
    Reng,
    /// NGD baseline: K-FAC with factored Tikhonov damping and π, inverse every step.
    Ngd,
    /// R-Kalman: diagonal Kalman filter with the regularized observation noise (docs/math.md §3).
    RKalman,
    /// Plain diagonal Kalman filter (R-Kalman with `ρ = 0`).
    Kalman,
    /// AdamW with linear warm-up.
    AdamW,
    /// SGD with heavy-ball momentum.
    Sgd,
    /// Sophia-G (Gauss–Newton–Bartlett diagonal Hessian estimate).
    Sophia,
}

impl Method {
    /// Every method, in the order the main job trains and reports them.
    pub const ALL: [Method; 8] = [
        Method::Ring,
        Method::Reng,
        Method::Ngd,
        Method::RKalman,
        Method::Kalman,
        Method::AdamW,
        Method::Sgd,
        Method::Sophia,
    ];

    /// The command-line name (`ring`, `reng`, `ngd`, `rkalman`, `kalman`, `adamw`, `sgd`,
    /// `sophia`).
    pub fn key(self) -> &'static str {
        match self {
            Method::Ring => "ring",
            Method::Reng => "reng",
            Method::Ngd => "ngd",
            Method::RKalman => "rkalman",
            Method::Kalman => "kalman",
            Method::AdamW => "adamw",
            Method::Sgd => "sgd",
            Method::Sophia => "sophia",
        }
    }

    /// The display name used in tables and figures (the paper's spelling).
    pub fn label(self) -> &'static str {
        match self {
            Method::Ring => "RING",
            Method::Reng => "RENG",
            Method::Ngd => "NGD",
            Method::RKalman => "R-Kalman",
            Method::Kalman => "Kalman",
            Method::AdamW => "AdamW",
            Method::Sgd => "SGD",
            Method::Sophia => "Sophia",
        }
    }

    /// Kronecker-factored methods (RING, RENG, NGD): per-layer statistics, LM damping.
    pub fn is_kronecker(self) -> bool {
        matches!(self, Method::Ring | Method::Reng | Method::Ngd)
    }

    /// Kalman-filter methods (R-Kalman, Kalman): output Jacobian, no gradient step.
    pub fn is_kalman(self) -> bool {
        matches!(self, Method::RKalman | Method::Kalman)
    }

    /// Parses a comma-separated list (`"ring,adamw"`, case-insensitive, `all` for every
    /// method); duplicates are dropped, order is kept.
    ///
    /// # Errors
    /// [`UnknownMethod`] for an unknown name or an empty list.
    pub fn parse_list(list: &str) -> Result<Vec<Method>, UnknownMethod> {
        let mut out: Vec<Method> = Vec::new();
        for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let add: Vec<Method> = if name.eq_ignore_ascii_case("all") {
                Method::ALL.to_vec()
            } else {
                vec![name.parse()?]
            };
            for m in add {
                if !out.contains(&m) {
                    out.push(m);
                }
            }
        }
        if out.is_empty() {
            return Err(UnknownMethod(list.to_string()));
        }
        Ok(out)
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

impl FromStr for Method {
    type Err = UnknownMethod;

    /// Accepts the [`Method::key`] names and the labels, case-insensitively (`r-kalman` too).
    fn from_str(s: &str) -> Result<Self, UnknownMethod> {
        let norm: String = s
            .trim()
            .chars()
            .filter(|c| *c != '-' && *c != '_')
            .collect::<String>()
            .to_ascii_lowercase();
        Method::ALL
            .into_iter()
            .find(|m| m.key() == norm)
            .ok_or_else(|| UnknownMethod(s.to_string()))
    }
}
