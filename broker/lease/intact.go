package lease

import (
	"crypto/sha256"
	"encoding/binary"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/tokenbroker/tokenbroker/broker/objects"
)

// Whoever may patch Secrets in a lease's namespace (a tenant, unless the
// lease admission policy is on) can edit the labels and annotations of a
// lease Secret, but not its name, namespace, UID, type or creation time.
// So the broker never lets a label decide whether a lease exists or whose
// it is, and never trusts a lease Secret someone else edited:
//
//   - A holder's lookup by id (Store.Find) reads the Secrets named after
//     the id (the API server keeps a name unique in its namespace), of the
//     lease type, by name and type alone; the earliest created is the
//     lease, and it is the caller's if its identity annotation is the
//     caller's identity (or, edited since, was when the counter last saw
//     it intact). No label is needed to find, nor can one hide, a lease.
//   - The counter watches every Secret of the lease type, whatever its
//     labels, so no edit takes a lease out of its sight. A lease Secret is
//     intact when it bears every mark the broker writes on a lease
//     (Intact); the counter holds for the gateway only an intact one.
//   - A lease Secret the counter saw intact that changes under the same
//     UID in anything the broker never changes after it wrote it (the
//     labels and annotations of leaseSignature, its kind, or an expiry
//     that moves later or becomes unreadable) is tampered, for good: it
//     is no longer held, counted or trusted, and the GC revokes it
//     (deletes it with its UID as precondition) as the lease of the
//     holder it named before the edit. A Secret first seen not intact
//     holds no gateway lease, and is revoked by its holder's DELETE or at
//     its expiry, not by the broker on its own: it cannot tell whether it
//     made it.

// Intact reports whether s bears every mark the broker writes on a lease
// Secret: the lease type and a lease name, the labels managed-by,
// kind=lease, lease-id equal to the id in its name, a peer, and the
// annotations identity and a readable expiry. Whether the policy bears
// that peer and identity out in that namespace is Rules' question.
func Intact(s *corev1.Secret) bool {
	return s.Type == objects.SecretTypeLease && intactMeta(s.Name, s.Labels, s.Annotations)
}

// intactMeta is Intact for a Secret already known to be of the lease type
// (the counter's watch selects on it).
func intactMeta(name string, labels, annotations map[string]string) bool {
	id := IDOf(name)
	if id == "" || labels[objects.LabelManagedBy] != objects.ManagedByValue || labels[objects.LabelKind] != objects.LeaseKind ||
		labels[objects.LabelLeaseID] != id || labels[objects.LabelPeer] == "" || annotations[objects.AnnotationIdentity] == "" {
		return false
	}
	_, err := time.Parse(time.RFC3339, annotations[objects.AnnotationExpiresAt])
	return err == nil
}

// IDOf is the lease id a lease Secret's name records ("" if name is not
// a lease Secret's name). The name cannot be edited, the lease-id label
// can.
func IDOf(name string) string {
	id, ok := strings.CutPrefix(name, objects.LeaseSecretPrefix)
	if !ok {
		return ""
	}
	return id
}

// The labels and annotations the broker writes once, when it makes the
// lease (or claims a pooled Secret as one), and never changes: an edit
// of any of them is someone else's. The broker's later writes are the
// credential id and an earlier expiry (Store.RecordCredential).
var (
	signatureLabels = []string{objects.LabelManagedBy, objects.LabelKind, objects.LabelLeaseID, objects.LabelPeer,
		objects.LabelKeyFingerprint}
	signatureAnnotations = []string{objects.AnnotationIdentity, objects.AnnotationWorkload, objects.AnnotationSA,
		objects.AnnotationCred, objects.AnnotationUser, objects.AnnotationAccess, objects.AnnotationGrant,
		objects.AnnotationRevokeOnUnmatch}
)

// signature is what the counter keeps of a lease's never-changed labels
// and annotations.
type signature [16]byte

// leaseSignature is a hash of the labels and annotations the broker never
// changes on a lease (signatureLabels, signatureAnnotations; each present
// or absent, and its value): the counter keeps it, not the values, so
// that noticing an edit costs a lease 16 bytes. It is SHA-256 (cut to
// 128 bits), not a fast hash, because whoever edits the Secret chooses
// the values: they must not be able to make an edit hash as the original.
func leaseSignature(labels, annotations map[string]string) signature {
	h := sha256.New()
	var n [binary.MaxVarintLen64]byte
	for _, set := range []struct {
		keys []string
		m    map[string]string
	}{{signatureLabels, labels}, {signatureAnnotations, annotations}} {
		for _, k := range set.keys {
			v, ok := set.m[k]
			if !ok {
				h.Write([]byte{0})
				continue
			}
			h.Write([]byte{1})
			h.Write(n[:binary.PutUvarint(n[:], uint64(len(v)))])
			h.Write([]byte(v))
		}
	}
	var sig signature
	copy(sig[:], h.Sum(nil))
	return sig
}
