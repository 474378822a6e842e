//! Parsing of `#[recovery_unit(...)]` arguments.

use crate::ctxt::Ctxt;
use proc_macro2::{Span, TokenStream};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{Expr, Lit, Meta, Token};

const VALID: &str =
    "the arguments are `cost = <expr>`, `deterministic`, `name = \"...\"` and `codecs = [\"...\", ...]`";

pub(crate) struct Args {
    pub cost: Option<Expr>,
    pub deterministic: bool,
    pub name: Option<syn::LitStr>,
    pub codecs: Option<Vec<syn::LitStr>>,
}

pub(crate) fn parse(cx: &mut Ctxt, tokens: TokenStream) -> Args {
    let mut args = Args {
        cost: None,
        deterministic: false,
        name: None,
        codecs: None,
    };
    let metas = match Punctuated::<Meta, Token![,]>::parse_terminated.parse2(tokens) {
        Ok(m) => m,
        Err(e) => {
            cx.syn_error(syn::Error::new(
                e.span(),
                format!("malformed #[recovery_unit] arguments: {e}; {VALID}"),
            ));
            return args;
        }
    };
    let mut seen: Vec<(String, Span)> = Vec::new();
    for meta in metas {
        let path = meta.path();
        let Some(ident) = path.get_ident().map(|i| i.to_string()) else {
            cx.error_spanned_by(path, format!("unknown argument; {VALID}"));
            continue;
        };
        if seen.iter().any(|(n, _)| *n == ident) {
            cx.error_spanned_by(path, format!("duplicate argument `{ident}`: give it once"));
            continue;
        }
        seen.push((ident.clone(), Span::call_site()));
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
                v => cx.error_spanned_by(v, "`name` takes a non-empty string literal: `name = \"mlp.down\"`"),
            },
            ("name", m) => cx.error_spanned_by(m, "`name` needs a value: `name = \"mlp.down\"`"),
            ("codecs", Meta::NameValue(nv)) => {
                let mut list = Vec::new();
                match &nv.value {
                    Expr::Array(arr) if !arr.elems.is_empty() => {
                        for e in &arr.elems {
                            match e {
                                Expr::Lit(syn::ExprLit {
                                    lit: Lit::Str(s), ..
                                }) => list.push(s.clone()),
                                other => cx.error_spanned_by(other, "`codecs` lists codec names as string literals: `codecs = [\"bf16\", \"fp8-e4m3-b32\"]`"),
                            }
                        }
                        args.codecs = Some(list);
                    }
                    v => cx.error_spanned_by(v, "`codecs` takes a non-empty array of codec names: `codecs = [\"bf16\"]`"),
                }
            }
            ("codecs", m) => cx.error_spanned_by(m, "`codecs` needs a value: `codecs = [\"bf16\"]`"),
            (other, m) => cx.error_spanned_by(m.path(), format!("unknown argument `{other}`; {VALID}")),
        }
    }
    args
}
