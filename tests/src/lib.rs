//! Shared fixtures for Tessera's cross-crate tests (see `tests/`).

pub mod agreement;
pub mod backends;
pub mod bench;
pub mod kit;
pub mod probes;
pub mod rulebook;
pub mod vmem;
pub mod broken;
pub mod conformance;
pub mod hardening;
pub mod oracle;
pub mod nonfinite;

/// `f` over `items` on a thread per core, results in `items`' order: for a test whose cases
/// are independent and long enough that one thread would leave the other cores idle.
pub fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).min(items.len().max(1));
    let mut done: Vec<(usize, R)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break out };
                        out.push((i, f(item)));
                    }
                })
            })
            .collect();
        // A panicking case fails the test with its own message (resumed here).
        handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    done.sort_by_key(|&(i, _)| i);
    done.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn par_map_keeps_the_order() {
        let items: Vec<u64> = (0..1000).collect();
        assert_eq!(super::par_map(&items, |&i| i * i), items.iter().map(|i| i * i).collect::<Vec<_>>());
    }

    #[test]
    #[should_panic(expected = "item 7 is wrong")]
    fn par_map_fails_with_the_cases_message() {
        super::par_map(&(0..20).collect::<Vec<u32>>(), |&i| assert!(i != 7, "item {i} is wrong"));
    }
}
