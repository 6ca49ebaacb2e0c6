//! What the writer computes while the document streams: its SHA-256, part
//! after part, on the blocking pool, while the parts upload.
//!
//! Hashing 8 MiB takes milliseconds: done by the appending task it would
//! stall the appends, and done on a runtime worker it would stall the
//! connections' I/O. So each part gets a [`HashLink`] when it is sent, in
//! part order; its task hashes the part once every earlier part is hashed,
//! and hands the state on. [`HashChain::finish`] waits for the last link.

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

/// The document's SHA-256, computed part after part (see the module).
pub(super) struct HashChain {
    /// The state after the last linked part, once that part is hashed.
    end: oneshot::Receiver<Sha256>,
    links: u32,
}

impl HashChain {
    pub(super) fn new() -> Self {
        let (sender, receiver) = oneshot::channel();
        let _ = sender.send(Sha256::new());
        HashChain {
            end: receiver,
            links: 0,
        }
    }

    /// The next place in the chain, taken in part order; its part's bytes
    /// come later ([`HashLink::hash_while`]), once they are in memory. If a
    /// link is dropped unfinished (its part failed or was cancelled), the
    /// chain stays broken and [`HashChain::finish`] says so.
    pub(super) fn link(&mut self) -> HashLink {
        let (sender, receiver) = oneshot::channel();
        let previous = std::mem::replace(&mut self.end, receiver);
        let first_link = self.links == 0;
        self.links += 1;
        HashLink {
            previous,
            sender,
            first_link,
        }
    }

    /// The lowercase hex SHA-256 of every linked part, in order; `None` if a
    /// link never finished.
    pub(super) async fn finish(self) -> Option<String> {
        let hasher = self.end.await.ok()?;
        Some(hex::encode(hasher.finalize()))
    }
}

/// One part's place in a [`HashChain`].
pub(super) struct HashLink {
    previous: oneshot::Receiver<Sha256>,
    sender: oneshot::Sender<Sha256>,
    first_link: bool,
}

impl HashLink {
    /// Hashes `part` into the document's SHA-256 while `store` sends it, and
    /// returns what `store` returned.
    ///
    /// `store` gets the SHA-256 of the part to hand to SigV4 when the writer
    /// `signs_payload` and this is the first link: the first part's SHA-256
    /// is the document hash so far, so it is computed first and the bytes
    /// are hashed once, not twice. Otherwise `store` gets `None` and the
    /// hashing runs beside it.
    pub(super) async fn hash_while<Stored, Store>(
        self,
        part: Bytes,
        signs_payload: bool,
        store: impl FnOnce(Option<String>) -> Store,
    ) -> Stored
    where
        Store: Future<Output = Stored>,
    {
        let hash_first = signs_payload && self.first_link;
        let hashing = self.hash(part);
        if hash_first {
            let payload_sha256 = hashing.await;
            store(payload_sha256).await
        } else {
            let (stored, _) = tokio::join!(store(None), hashing);
            stored
        }
    }

    /// The work of hashing `part` after every part linked before it. The
    /// first link also yields the SHA-256 of its part alone (lowercase hex),
    /// which is the document hash so far; later links yield `None`.
    fn hash(self, part: Bytes) -> impl Future<Output = Option<String>> + Send + 'static {
        let HashLink {
            previous,
            sender,
            first_link,
        } = self;
        async move {
            let mut hasher = previous.await.ok()?;
            let (hasher, part_sha256) = tokio::task::spawn_blocking(move || {
                hasher.update(&part);
                let part_sha256 = first_link.then(|| hex::encode(hasher.clone().finalize()));
                (hasher, part_sha256)
            })
            .await
            .ok()?;
            let _ = sender.send(hasher);
            part_sha256
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha256_hex(bytes: &[u8]) -> String {
        hex::encode(Sha256::digest(bytes))
    }

    /// Parts hashed in any order of their tasks give the hash of the parts
    /// in link order.
    #[tokio::test]
    async fn parts_hashed_out_of_order_give_the_hash_of_the_document_in_order() {
        let parts: Vec<Bytes> = ["first ", "second ", "third"]
            .map(|text| Bytes::from_static(text.as_bytes()))
            .into();
        let mut chain = HashChain::new();
        let links: Vec<HashLink> = parts.iter().map(|_| chain.link()).collect();
        let mut tasks = Vec::new();
        for (link, part) in links.into_iter().zip(parts).rev() {
            tasks.push(tokio::spawn(link.hash_while(
                part,
                false,
                |payload| async move { payload },
            )));
        }
        for task in tasks {
            assert_eq!(task.await.unwrap(), None, "nothing to hand SigV4");
        }
        assert_eq!(
            chain.finish().await,
            Some(sha256_hex(b"first second third"))
        );
    }

    #[tokio::test]
    async fn only_the_first_link_hands_its_hash_to_a_signing_store() {
        let mut chain = HashChain::new();
        let (first, second) = (chain.link(), chain.link());
        let handed = first
            .hash_while(
                Bytes::from_static(b"ab"),
                true,
                |payload| async move { payload },
            )
            .await;
        assert_eq!(handed, Some(sha256_hex(b"ab")));
        let handed = second
            .hash_while(
                Bytes::from_static(b"cd"),
                true,
                |payload| async move { payload },
            )
            .await;
        assert_eq!(handed, None);
        assert_eq!(chain.finish().await, Some(sha256_hex(b"abcd")));
    }

    #[tokio::test]
    async fn a_link_dropped_unfinished_breaks_the_chain() {
        let mut chain = HashChain::new();
        drop(chain.link());
        let second = chain.link();
        second
            .hash_while(Bytes::from_static(b"cd"), false, |_| async {})
            .await;
        assert_eq!(chain.finish().await, None);
    }
}
