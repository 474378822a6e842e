//! Compile-time checks of a `deterministic` unit's body: no obvious nondeterminism.
//!
//! A deterministic unit may be recomputed in backward and must then reproduce its forward
//! bit for bit, so it cannot read clocks or draw from unseeded RNGs. Randomness must come
//! from the tape's counter-based generator (`cx.counter_uniform`, `cx.dropout`), which
//! replays identically. The check is syntactic: it catches the obvious sources.

use crate::ctxt::Ctxt;
use syn::visit::Visit;

/// What a `deterministic` unit is, said once in every message.
const WHY: &str =
    "a `deterministic` unit is re-run in backward and must reproduce its forward bit for bit";

/// The fix for randomness.
const RNG_FIX: &str = "draw randomness from the tape's counter-based RNG (`cx.counter_uniform(..)`, `cx.dropout(..)`), which replays identically, or remove `deterministic`";

/// Path segments that mark nondeterminism: what they do, and the fix.
const FORBIDDEN: &[(&str, &str, &str)] = &[
    ("thread_rng", "draws from a thread RNG, which gives other values on recompute", RNG_FIX),
    ("ThreadRng", "is a thread RNG, which gives other values on recompute", RNG_FIX),
    ("OsRng", "draws from the OS RNG, which gives other values on recompute", RNG_FIX),
    ("getrandom", "draws from the OS RNG, which gives other values on recompute", RNG_FIX),
    ("from_entropy", "seeds an RNG from entropy, which gives other values on recompute", RNG_FIX),
    ("from_os_rng", "seeds an RNG from the OS, which gives other values on recompute", RNG_FIX),
    (
        "SystemTime",
        "reads the clock, which reads differently on recompute",
        "compute time-dependent values outside the unit and pass them in as a `Var` or a `Copy` input, or remove `deterministic`",
    ),
    (
        "Instant",
        "reads the clock, which reads differently on recompute",
        "time the unit from outside its body, or pass time-dependent values in as a `Var` or a `Copy` input, or remove `deterministic`",
    ),
    (
        "RandomState",
        "seeds a hasher randomly, so iteration order differs on recompute",
        "use a `BTreeMap` or a `Vec`, or remove `deterministic`",
    ),
    (
        "HashMap",
        "iterates in a random order that differs on recompute",
        "use a `BTreeMap` or a `Vec`, or remove `deterministic`",
    ),
    (
        "HashSet",
        "iterates in a random order that differs on recompute",
        "use a `BTreeSet` or a `Vec`, or remove `deterministic`",
    ),
];

/// Function names (path tails like `Tensor::randn`, `rand::random`) of unseeded RNGs.
const FORBIDDEN_CALLS: &[&str] = &["randn", "rand", "randn_like", "rand_like", "random", "rng"];

/// Methods of unseeded tensor RNGs (`x.randn_like(..)`).
const FORBIDDEN_METHODS: &[&str] = &["randn_like", "rand_like"];

struct Finder<'a> {
    cx: &'a mut Ctxt,
}

impl Finder<'_> {
    fn path(&mut self, path: &syn::Path) {
        for seg in &path.segments {
            let s = seg.ident.to_string();
            if let Some((_, what, fix)) = FORBIDDEN.iter().find(|(n, _, _)| *n == s) {
                self.cx
                    .error_spanned_by(&seg.ident, format!("`{s}` {what}: {WHY}; {fix}"));
                return;
            }
        }
        if let [.., _, last] = path.segments.iter().collect::<Vec<_>>()[..] {
            let name = last.ident.to_string();
            if FORBIDDEN_CALLS.contains(&name.as_str()) {
                let text = crate::expand::render(quote::ToTokens::to_token_stream(path));
                self.cx.error_spanned_by(
                    path,
                    format!("`{text}` draws from an unseeded RNG, which gives other values on recompute: {WHY}; {RNG_FIX}"),
                );
            }
        }
    }
}

impl<'ast> Visit<'ast> for Finder<'_> {
    fn visit_path(&mut self, p: &'ast syn::Path) {
        self.path(p);
        syn::visit::visit_path(self, p);
    }

    fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
        let name = m.method.to_string();
        if FORBIDDEN_METHODS.contains(&name.as_str()) {
            self.cx.error_spanned_by(
                &m.method,
                format!("`.{name}()` draws from an unseeded RNG, which gives other values on recompute: {WHY}; {RNG_FIX}"),
            );
        }
        syn::visit::visit_expr_method_call(self, m);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.path(&m.path);
        // Look inside macro calls whose arguments parse as expressions (println!, vec!, ...).
        if let Ok(args) = m.parse_body_with(
            syn::punctuated::Punctuated::<syn::Expr, syn::Token![,]>::parse_terminated,
        ) {
            for a in &args {
                self.visit_expr(a);
            }
        }
    }
}

pub(crate) fn check_deterministic(cx: &mut Ctxt, block: &syn::Block) {
    Finder { cx }.visit_block(block);
}
