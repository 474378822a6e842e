//! A typed view of the annotated function's signature.

use crate::ctxt::Ctxt;
use syn::{FnArg, Ident, ItemFn, Pat, ReturnType, Type};

/// How the unit sees one parameter.
pub(crate) enum ParamRole {
    /// The tape context `&mut Cx` (at most one).
    Context,
    /// A replayable input taken by reference: `&U`; `U` must be `Replayable`.
    ByRef(Type),
    /// A replayable input taken by value: `T` must be `ReplayOwned`.
    ByValue(Type),
}

pub(crate) struct Param {
    pub ident: Ident,
    pub pat: Pat,
    pub ty: Type,
    pub role: ParamRole,
    pub is_tape: bool,
}

pub(crate) struct Signature {
    /// Whether the function takes `&self`.
    pub receiver: bool,
    pub params: Vec<Param>,
    /// The lifetime written on `Cx<'a>`, if any.
    pub cx_lifetime: Option<syn::Lifetime>,
}

/// Whether `ty` is `&mut Cx` / `&mut path::Cx<..>`; returns the lifetime argument of `Cx`.
fn as_cx(ty: &Type) -> Option<Option<Option<syn::Lifetime>>> {
    let Type::Reference(r) = ty else { return None };
    let Type::Path(p) = &*r.elem else { return None };
    let last = p.path.segments.last()?;
    if last.ident != "Cx" {
        return None;
    }
    let lt = match &last.arguments {
        syn::PathArguments::AngleBracketed(a) => a.args.iter().find_map(|g| match g {
            syn::GenericArgument::Lifetime(l) if l.ident != "_" => Some(l.clone()),
            _ => None,
        }),
        _ => None,
    };
    Some(if r.mutability.is_some() { Some(lt) } else { None })
}

fn mentions_var(ty: &Type) -> bool {
    fn walk(ts: proc_macro2::TokenStream) -> bool {
        ts.into_iter().any(|t| match t {
            proc_macro2::TokenTree::Ident(i) => i == "Var",
            proc_macro2::TokenTree::Group(g) => walk(g.stream()),
            _ => false,
        })
    }
    walk(quote::quote!(#ty))
}

fn contains_impl_trait(ty: &Type) -> bool {
    match ty {
        Type::ImplTrait(_) => true,
        Type::Reference(r) => contains_impl_trait(&r.elem),
        Type::Slice(s) => contains_impl_trait(&s.elem),
        Type::Array(a) => contains_impl_trait(&a.elem),
        Type::Paren(p) => contains_impl_trait(&p.elem),
        Type::Tuple(t) => t.elems.iter().any(contains_impl_trait),
        Type::Path(p) => p.path.segments.iter().any(|s| match &s.arguments {
            syn::PathArguments::AngleBracketed(a) => a.args.iter().any(|g| match g {
                syn::GenericArgument::Type(t) => contains_impl_trait(t),
                _ => false,
            }),
            _ => false,
        }),
        _ => false,
    }
}

pub(crate) fn analyze(cx: &mut Ctxt, f: &ItemFn) -> Signature {
    let sig = &f.sig;
    if let Some(a) = &sig.asyncness {
        cx.error_spanned_by(a, "a recovery unit cannot be `async`: backward re-runs its body synchronously; make it a plain `fn`");
    }
    if let Some(c) = &sig.constness {
        cx.error_spanned_by(c, "a recovery unit cannot be `const`: it runs ops on the tape; remove `const`");
    }
    if let Some(abi) = &sig.abi {
        cx.error_spanned_by(abi, "a recovery unit cannot have an `extern` ABI; remove it");
    }
    if let Some(v) = &sig.variadic {
        cx.error_spanned_by(v, "a recovery unit cannot be variadic");
    }
    for g in &sig.generics.params {
        if let syn::GenericParam::Const(c) = g {
            // Const generics are fine as configuration; nothing to check.
            let _ = c;
        }
    }
    let mut out = Signature {
        receiver: false,
        params: Vec::new(),
        cx_lifetime: None,
    };
    let mut cx_count = 0;
    for arg in &sig.inputs {
        match arg {
            FnArg::Receiver(r) => {
                if r.colon_token.is_some() {
                    cx.error_spanned_by(r, "a recovery unit method takes `&self`; other receiver types are not supported");
                } else if r.reference.is_none() {
                    cx.error_spanned_by(r, "a recovery unit cannot take `self` by value: the module must outlive the tape that recomputes it; take `&self`");
                } else if r.mutability.is_some() {
                    cx.error_spanned_by(r, "a recovery unit cannot take `&mut self`: recompute replays the body later and mutable state cannot be replayed; take `&self` and keep mutable state outside the unit");
                } else {
                    out.receiver = true;
                }
            }
            FnArg::Typed(pt) => {
                let ident = match &*pt.pat {
                    Pat::Ident(pi) if pi.by_ref.is_none() && pi.subpat.is_none() => pi.ident.clone(),
                    other => {
                        cx.error_spanned_by(other, "unsupported parameter pattern in a recovery unit: bind each parameter to a plain name (`x: &Var`)");
                        continue;
                    }
                };
                let ty = (*pt.ty).clone();
                if let Some(lt) = as_cx(&ty) {
                    match lt {
                        Some(lt) => {
                            cx_count += 1;
                            if cx_count > 1 {
                                cx.error_spanned_by(&pt.ty, "a recovery unit takes the tape context `&mut Cx` once");
                            }
                            out.cx_lifetime = lt;
                            out.params.push(Param {
                                ident,
                                pat: (*pt.pat).clone(),
                                ty,
                                role: ParamRole::Context,
                                is_tape: false,
                            });
                        }
                        None => cx.error_spanned_by(&pt.ty, "the tape context must be taken as `&mut Cx`: units record ops on it"),
                    }
                    continue;
                }
                if contains_impl_trait(&ty) {
                    cx.error_spanned_by(&pt.ty, "a recovery unit cannot take `impl Trait` parameters: the recompute closure needs a nameable type; use a generic parameter `T: Trait`");
                    continue;
                }
                let role = match &ty {
                    Type::Reference(r) if r.mutability.is_some() => {
                        cx.error_spanned_by(&pt.ty, format!("`{}` is `&mut`: a recovery unit's inputs cannot be replayed if the unit may mutate them; take `&` or move the state into the module", ident));
                        continue;
                    }
                    Type::Reference(r) => ParamRole::ByRef((*r.elem).clone()),
                    _ => ParamRole::ByValue(ty.clone()),
                };
                out.params.push(Param {
                    is_tape: mentions_var(&ty),
                    ident,
                    pat: (*pt.pat).clone(),
                    ty,
                    role,
                });
            }
        }
    }
    if cx_count == 0 {
        cx.error_spanned_by(&sig.ident, format!("`{}` takes no tape context: a recovery unit records its ops on the tape, add a parameter `cx: &mut Cx`", sig.ident));
    }
    let ok_ret = match &sig.output {
        ReturnType::Type(_, ty) => match &**ty {
            Type::Path(p) => p.path.segments.last().is_some_and(|s| s.ident == "Result"),
            _ => false,
        },
        ReturnType::Default => false,
    };
    if !ok_ret {
        let msg = "a recovery unit returns `Result<...>` of its output tape values (e.g. `-> Result<Var>`): recompute and fidelity errors must be able to surface";
        match &sig.output {
            ReturnType::Type(_, ty) => cx.error_spanned_by(ty, msg),
            ReturnType::Default => cx.error_spanned_by(&sig.ident, msg),
        }
    }
    out
}
