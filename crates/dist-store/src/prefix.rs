//! [`PrefixStore`]: a view of a store whose keys all lie under `prefix/`, as PyTorch's
//! `PrefixStore` (which joins prefix and key with `/`).

use std::time::Duration;

use crate::Store;
use crate::error::Result;

/// Every key `k` of this store is `prefix/k` in the store beneath it. Prefix stores nest.
#[derive(Debug)]
pub struct PrefixStore<S> {
    prefix: String,
    inner: S,
}

impl<S: Store> PrefixStore<S> {
    /// A view of `inner` under `prefix` (`&store`, `Arc<store>` or a store by value).
    pub fn new(prefix: impl Into<String>, inner: S) -> PrefixStore<S> {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix (without the `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The store beneath.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn k(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }

    fn ks(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.k(k)).collect()
    }
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

impl<S: Store> Store for PrefixStore<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.k(key), value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.k(key), timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.k(key), delta)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.k(key), expected, desired)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.inner.wait(&refs(&self.ks(keys)), timeout)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.inner.check(&refs(&self.ks(keys)))
    }
    fn delete_key(&self, key: &str) -> Result<bool> {
        self.inner.delete_key(&self.k(key))
    }
    fn num_keys(&self) -> Result<i64> {
        self.inner.num_keys()
    }
    fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.append(&self.k(key), value)
    }
    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.inner.multi_get(&refs(&self.ks(keys)), timeout)
    }
    fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()> {
        self.inner.multi_set(&refs(&self.ks(keys)), values)
    }
    fn queue_push(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.queue_push(&self.k(key), value)
    }
    fn queue_pop(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.queue_pop(&self.k(key), timeout)
    }
    fn try_queue_pop(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.inner.try_queue_pop(&self.k(key))
    }
    fn queue_len(&self, key: &str) -> Result<i64> {
        self.inner.queue_len(&self.k(key))
    }
    fn list_keys(&self) -> Result<Vec<String>> {
        let p = format!("{}/", self.prefix);
        Ok(self
            .inner
            .list_keys()?
            .into_iter()
            .filter_map(|k| k.strip_prefix(&p).map(str::to_owned))
            .collect())
    }
    fn barrier(&self, key: &str, world_size: usize, timeout: Duration) -> Result<()> {
        self.inner.barrier(&self.k(key), world_size, timeout)
    }
}

macro_rules! forward {
    ($($t:ty),*) => {$(
        impl<S: Store + ?Sized> Store for $t {
            fn set(&self, key: &str, value: &[u8]) -> Result<()> { (**self).set(key, value) }
            fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
                (**self).get(key, timeout)
            }
            fn add(&self, key: &str, delta: i64) -> Result<i64> { (**self).add(key, delta) }
            fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
                (**self).compare_set(key, expected, desired)
            }
            fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
                (**self).wait(keys, timeout)
            }
            fn check(&self, keys: &[&str]) -> Result<bool> { (**self).check(keys) }
            fn delete_key(&self, key: &str) -> Result<bool> { (**self).delete_key(key) }
            fn num_keys(&self) -> Result<i64> { (**self).num_keys() }
            fn append(&self, key: &str, value: &[u8]) -> Result<()> { (**self).append(key, value) }
            fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
                (**self).multi_get(keys, timeout)
            }
            fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()> {
                (**self).multi_set(keys, values)
            }
            fn queue_push(&self, key: &str, value: &[u8]) -> Result<()> {
                (**self).queue_push(key, value)
            }
            fn queue_pop(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
                (**self).queue_pop(key, timeout)
            }
            fn try_queue_pop(&self, key: &str) -> Result<Option<Vec<u8>>> {
                (**self).try_queue_pop(key)
            }
            fn queue_len(&self, key: &str) -> Result<i64> { (**self).queue_len(key) }
            fn list_keys(&self) -> Result<Vec<String>> { (**self).list_keys() }
            fn barrier(&self, key: &str, world_size: usize, timeout: Duration) -> Result<()> {
                (**self).barrier(key, world_size, timeout)
            }
        }
    )*};
}

forward!(&S, std::sync::Arc<S>, Box<S>);
