//! Which path the generated code names the DSL by. Tessera's own crates depend on
//! `tessera-dsl`; a user's crate depends on the one `tessera` crate, which re-exports it
//! as `tessera::dsl`. The expansion is written against `::tessera_dsl` and rewritten here
//! when the crate being compiled declares `tessera` but not `tessera-dsl` (as
//! proc-macro-crate does, from the crate's own manifest).

use proc_macro2::{Group, Ident, Punct, Spacing, TokenStream, TokenTree};

/// `t` with every `tessera_dsl` ident replaced by `tessera::dsl` when the crate being
/// compiled reaches the DSL through the `tessera` crate.
pub fn resolve(t: TokenStream) -> TokenStream {
    if through_tessera() {
        rewrite(t)
    } else {
        t
    }
}

fn through_tessera() -> bool {
    let Some(dir) = std::env::var_os("CARGO_MANIFEST_DIR") else { return false };
    let Ok(manifest) = std::fs::read_to_string(std::path::Path::new(&dir).join("Cargo.toml")) else { return false };
    // A dependency line is `name = ..`, `name.workspace = true` or a `[..dependencies.name]` table.
    let declares = |name: &str| {
        manifest.lines().map(str::trim).any(|l| {
            let key = l.strip_prefix('[').and_then(|l| l.trim_end_matches(']').rsplit_once('.')).map_or(l, |(_, k)| k);
            key.strip_prefix(name).is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '=', '.']))
        })
    };
    declares("tessera") && !declares("tessera-dsl")
}

fn rewrite(t: TokenStream) -> TokenStream {
    let mut out = TokenStream::new();
    for tt in t {
        match tt {
            TokenTree::Ident(i) if i == "tessera_dsl" => {
                let span = i.span();
                let mut colons = [Punct::new(':', Spacing::Joint), Punct::new(':', Spacing::Alone)];
                colons.iter_mut().for_each(|p| p.set_span(span));
                out.extend([TokenTree::Ident(Ident::new("tessera", span)), colons[0].clone().into(), colons[1].clone().into(), TokenTree::Ident(Ident::new("dsl", span))]);
            }
            TokenTree::Group(g) => {
                let mut ng = Group::new(g.delimiter(), rewrite(g.stream()));
                ng.set_span(g.span());
                out.extend([TokenTree::Group(ng)]);
            }
            other => out.extend([other]),
        }
    }
    out
}
