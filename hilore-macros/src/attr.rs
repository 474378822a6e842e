//! Parsing of `#[recovery_unit(...)]` arguments.

use crate::ctxt::Ctxt;
use proc_macro2::TokenStream;
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{Expr, Lit, Meta, Token};

/// The argument names, for suggestions.
const NAMES: [&str; 4] = ["cost", "deterministic", "name", "codecs"];

const VALID: &str =
    "the arguments are `cost = <expr>` (required), `deterministic`, `name = \"...\"` and `codecs = [\"...\", ...]`";

pub(crate) struct Args {
    pub cost: Option<Expr>,
    pub deterministic: bool,
    pub name: Option<syn::LitStr>,
    pub codecs: Option<Vec<syn::LitStr>>,
    /// Whether `cost` was written at all (possibly malformed), or the arguments could not
    /// be parsed: either way a "missing cost" error would only repeat another one.
    pub cost_reported: bool,
}

pub(crate) fn parse(cx: &mut Ctxt, tokens: TokenStream) -> Args {
    let mut args = Args {
        cost: None,
        deterministic: false,
        name: None,
        codecs: None,
        cost_reported: false,
    };
    let metas = match Punctuated::<Meta, Token![,]>::parse_terminated.parse2(tokens) {
        Ok(m) => m,
        Err(e) => {
            cx.error_at(
                e.span(),
                format!(
                    "malformed `#[recovery_unit]` arguments ({e}): write them as \
                     `#[recovery_unit(cost = <expr>, deterministic)]`; {VALID}"
                ),
            );
            args.cost_reported = true;
            return args;
        }
    };
    let mut seen: Vec<String> = Vec::new();
    for meta in metas {
        let path = meta.path();
        let Some(ident) = path.get_ident().map(|i| i.to_string()) else {
            cx.error_spanned_by(
                path,
                format!(
                    "unknown argument `{}`: {VALID}",
                    crate::expand::render(quote::ToTokens::to_token_stream(path))
                ),
            );
            continue;
        };
        if ident == "cost" {
            args.cost_reported = true;
        }
        if seen.contains(&ident) {
            cx.error_spanned_by(
                path,
                format!("`{ident}` is given twice: keep one `{ident}` argument"),
            );
            continue;
        }
        seen.push(ident.clone());
        match (ident.as_str(), meta) {
            ("cost", Meta::NameValue(nv)) => args.cost = Some(nv.value),
            ("cost", m) => cx.error_spanned_by(
                m,
                "`cost` needs a value: write `cost = <expr>`, an estimate of the unit's forward cost evaluated on its inputs (e.g. `cost = 2 * x.elem_count()`)",
            ),
            ("deterministic", Meta::Path(_)) => args.deterministic = true,
            ("deterministic", m) => cx.error_spanned_by(
                m,
                "`deterministic` is a flag and takes no value: write `deterministic`, or leave it out if the unit must never be recomputed",
            ),
            ("name", Meta::NameValue(nv)) => match nv.value {
                Expr::Lit(syn::ExprLit {
                    lit: Lit::Str(s), ..
                }) if !s.value().is_empty() => args.name = Some(s),
                v => cx.error_spanned_by(
                    v,
                    "`name` takes a non-empty string literal: `name = \"mlp.down\"`",
                ),
            },
            ("name", m) => cx.error_spanned_by(m, "`name` needs a value: `name = \"mlp.down\"`"),
            ("codecs", Meta::NameValue(nv)) => match &nv.value {
                Expr::Array(arr) if !arr.elems.is_empty() => {
                    let mut list = Vec::new();
                    for e in &arr.elems {
                        match e {
                            Expr::Lit(syn::ExprLit {
                                lit: Lit::Str(s), ..
                            }) if !s.value().is_empty() => {
                                if hilore_kernels::codec_by_name(&s.value()).is_err() {
                                    cx.error_spanned_by(s, unknown_codec(&s.value()));
                                }
                                list.push(s.clone())
                            }
                            other => cx.error_spanned_by(
                                other,
                                "`codecs` lists codec names as string literals: `codecs = [\"bf16\", \"fp8-e4m3-b32\"]`",
                            ),
                        }
                    }
                    args.codecs = Some(list);
                }
                v => cx.error_spanned_by(
                    v,
                    "`codecs` takes a non-empty array of codec names: `codecs = [\"bf16\"]`",
                ),
            },
            ("codecs", m) => cx.error_spanned_by(m, "`codecs` needs a value: `codecs = [\"bf16\"]`"),
            (other, m) => {
                let msg = match closest(other) {
                    Some(n) => format!("unknown argument `{other}`: did you mean `{n}`? ({VALID})"),
                    None => format!("unknown argument `{other}`: {VALID}"),
                };
                cx.error_spanned_by(m.path(), msg)
            }
        }
    }
    args
}

/// The argument name closest to `s`, if it is a plausible typo of it.
/// The message for a `codecs` entry that names no codec: the valid names, and the one
/// meant when it is close or a prefix (`fp8` for `fp8-e4m3-b32`).
fn unknown_codec(name: &str) -> String {
    let names = hilore_kernels::codec_names();
    let near: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| n.starts_with(name) || levenshtein(name, n) <= (n.len() / 3).max(1))
        .collect();
    let hint = match near.as_slice() {
        [] => String::new(),
        [one] => format!("; did you mean `{one}`?"),
        many => format!("; did you mean one of {}?", many.join(", ")),
    };
    format!(
        "unknown codec `{name}` in `codecs`; the codecs are {}{hint}",
        names.join(", ")
    )
}

fn closest(s: &str) -> Option<&'static str> {
    NAMES
        .iter()
        .map(|n| (levenshtein(s, n), *n))
        .filter(|(d, n)| *d <= (n.len() / 3).max(1))
        .min()
        .map(|(_, n)| n)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = if ca == *cb {
                prev
            } else {
                1 + prev.min(cur).min(row[j])
            };
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::closest;

    #[test]
    fn suggests_near_names_only() {
        assert_eq!(closest("determinstic"), Some("deterministic"));
        assert_eq!(closest("costs"), Some("cost"));
        assert_eq!(closest("codec"), Some("codecs"));
        assert_eq!(closest("flavour"), None);
    }
}
