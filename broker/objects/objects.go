// Package objects names the broker's objects in the Kubernetes API: the
// labels, annotations, kinds and Secret types by which a lease Secret, a
// pooled Secret, a used join token or an uploaded key set is written,
// selected and told apart from anything else. It holds names only; every
// package that reads or writes one of these objects uses them, so that a
// listing of one kind never shows another.
package objects

import corev1 "k8s.io/api/core/v1"

// Labels, annotations and the Secret type of a lease Secret.
const (
	LabelManagedBy = "app.kubernetes.io/managed-by"
	ManagedByValue = "tokenbroker"
	// LabelKind tells the broker's objects apart: LeaseKind for lease
	// Secrets, UsedJoinTokenKind for the records of used join tokens.
	// Listings select on it, so one kind never shows up as another.
	LabelKind           = "tokenbroker.io/kind"
	LeaseKind           = "lease"
	LabelLeaseID        = "tokenbroker.io/lease-id"
	LabelPeer           = "tokenbroker.io/peer"
	AnnotationExpiresAt = "tokenbroker.io/expires-at"
	AnnotationIdentity  = "tokenbroker.io/identity"
	AnnotationSA        = "tokenbroker.io/service-account"
	AnnotationCred      = "tokenbroker.io/credential"
	// AnnotationWorkload is the "namespace/serviceAccount" of the source
	// cluster's workload that asked, when it proved itself with a token.
	AnnotationWorkload = "tokenbroker.io/workload"
	// AnnotationUser is the per-lease user of a client-certificate lease,
	// and LabelKeyFingerprint its key's fingerprint (api/v1.KeyFingerprint):
	// a key may back one live lease only.
	AnnotationUser      = "tokenbroker.io/user"
	LabelKeyFingerprint = "tokenbroker.io/key-fingerprint"
	// AnnotationCredentialID is the lease's credential as the target's API
	// server names it in its audit log (user.extra
	// "authentication.kubernetes.io/credential-id"): "JTI=<jti>" for a
	// token, "X509SHA256=<hex sha256 of the certificate's DER>" for a
	// client certificate. Written once the credential exists, so that
	// "tokenbroker audit --kubeconfig" joins live leases.
	AnnotationCredentialID = "tokenbroker.io/credential-id"
	// AnnotationAccess marks a gateway lease (apiv1.AccessGateway); a
	// direct lease has none.
	AnnotationAccess = "tokenbroker.io/access"
	SecretTypeLease  = corev1.SecretType("tokenbroker.io/lease")
	// LeaseSecretPrefix starts the name of every lease Secret.
	LeaseSecretPrefix = "tokenbroker-lease-"
)

// The kinds (LabelKind) and Secret types of the broker's other objects.
const (
	// PoolKind is a pre-created, unclaimed lease Secret.
	PoolKind = "lease-pool"
	// UsedJoinTokenKind is the record of a used join token, in the
	// broker's namespace.
	UsedJoinTokenKind       = "used-join-token"
	SecretTypeUsedJoinToken = corev1.SecretType("tokenbroker.io/used-join-token")
	// PeerKeysKind is the key set a peer uploaded, in the broker's
	// namespace.
	PeerKeysKind       = "jwks"
	SecretTypePeerKeys = corev1.SecretType("tokenbroker.io/jwks")
)

// AnnotationGrant records on a lease the grant it was issued under (the
// grant's name, or "grants[i]" for an unnamed one), so that a namespace
// leaving a selector grant revokes exactly that grant's leases.
const AnnotationGrant = "tokenbroker.io/grant"

// AnnotationRevokeOnUnmatch marks a lease issued under a grant that revokes
// on unmatch (a selector grant without revokeOnUnmatch: false); its value
// is the grant's revokeDelay then ("0s", "30s"). It makes revocation
// durable: any replica's GC pass can tell, from the lease alone, that it
// is to be revoked once its grant no longer covers it, even after a reload
// removed the grant (or its peer) while no broker ran.
const AnnotationRevokeOnUnmatch = "tokenbroker.io/revoke-on-unmatch"
