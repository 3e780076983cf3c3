package lease

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	rbacv1client "k8s.io/client-go/kubernetes/typed/rbac/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
)

// Deleter revokes one lease, the one way every path does it: the broker's
// API, its GC and timers, and `tokenbroker leases revoke`. Deleting the
// lease Secret revokes every token bound to it; a client certificate's
// only permission is the RoleBinding the lease owns, deleted first so that
// the certificate is useless at once rather than when the garbage
// collector gets to it.
type Deleter struct {
	Secrets corev1client.SecretsGetter
	// RoleBindings, if set, lets a revocation delete a client
	// certificate's RoleBinding at once; nil leaves it to the garbage
	// collector (the lease owns it).
	RoleBindings rbacv1client.RoleBindingsGetter
	// Now times the API calls; nil means the wall clock.
	Now func() time.Time
	// Timed, if set, is told of every API call: its name, when it started
	// and its error.
	Timed func(ctx context.Context, call string, start time.Time, err error)
}

// ErrNotOwned is the answer for a RoleBinding of the lease's name that the
// lease does not own: a revocation leaves it alone.
var ErrNotOwned = errors.New("the RoleBinding of the lease's name is not owned by the lease; left alone")

func (d *Deleter) now() time.Time {
	if d.Now == nil {
		return time.Now()
	}
	return d.Now()
}

func (d *Deleter) timed(ctx context.Context, call string, start time.Time, err error) {
	if d.Timed != nil {
		d.Timed(ctx, call, start, err)
	}
}

// ErrGone is Revoke's answer for a lease Secret that was deleted before it
// got to it: revoked by someone else, or expired and collected.
var ErrGone = errors.New("the lease Secret was already gone")

// Revoke deletes lease s: the RoleBinding it owns first (a client
// certificate's only permission), then the Secret, with a UID
// precondition so that a namesake made since is never deleted. bindingErr
// reports a binding that could not be deleted (or ErrNotOwned); it does
// not fail the revocation, since the garbage collector deletes an owned
// binding with the lease. err is ErrGone if the Secret was gone already.
//
// The binding is looked for whatever the lease's credential annotation
// says: whoever may patch the Secret can rewrite it to "token" and hold the
// Secret with a finalizer, and the garbage collector keeps a binding while
// its owner is only being deleted, so trusting the annotation would leave a
// revoked certificate its rights. Only a binding the lease owns (by UID)
// is deleted. A broker not allowed to read RoleBindings issues no client
// certificate: for a lease that says it is no certificate, being refused
// the read is no error.
func (d *Deleter) Revoke(ctx context.Context, s *corev1.Secret) (bindingErr, err error) {
	if d.RoleBindings != nil {
		bindingErr = d.DeleteOwnedRoleBinding(ctx, s)
		if apierrors.IsForbidden(bindingErr) && s.Annotations[objects.AnnotationCred] != apiv1.CredentialClientCertificate {
			bindingErr = nil
		}
	}
	return bindingErr, d.deleteSecret(ctx, s, ErrGone)
}

// DeleteSecret deletes the lease Secret s, with its UID as precondition when
// it has one; a Secret already gone is no error.
func (d *Deleter) DeleteSecret(ctx context.Context, s *corev1.Secret) error {
	return d.deleteSecret(ctx, s, nil)
}

// deleteSecret deletes s and answers gone if it was gone already.
func (d *Deleter) deleteSecret(ctx context.Context, s *corev1.Secret, gone error) error {
	var opts metav1.DeleteOptions
	if s.UID != "" {
		uid := s.UID
		opts.Preconditions = &metav1.Preconditions{UID: &uid}
	}
	t0 := d.now()
	err := d.Secrets.Secrets(s.Namespace).Delete(ctx, s.Name, opts)
	if apierrors.IsNotFound(err) {
		d.timed(ctx, "delete_lease", t0, nil) // gone already: what a delete wants
		return gone
	}
	d.timed(ctx, "delete_lease", t0, err)
	if err != nil {
		return fmt.Errorf("delete lease Secret %s/%s: %w", s.Namespace, s.Name, err)
	}
	return nil
}

// DeleteOwnedRoleBinding deletes the RoleBinding of the client-certificate
// lease s only if s owns it (an ownerReference with s's UID), with a UID
// precondition, so that a revocation never deletes a binding someone else
// made under the same name, nor one made after the check.
func (d *Deleter) DeleteOwnedRoleBinding(ctx context.Context, s *corev1.Secret) error {
	if d.RoleBindings == nil {
		return nil // left to the garbage collector
	}
	rbs := d.RoleBindings.RoleBindings(s.Namespace)
	t0 := d.now()
	rb, err := rbs.Get(ctx, s.Name, metav1.GetOptions{})
	d.timed(ctx, "get_rolebinding", t0, err)
	switch {
	case apierrors.IsNotFound(err):
		return nil
	case err != nil:
		return fmt.Errorf("get RoleBinding %s/%s: %w", s.Namespace, s.Name, err)
	}
	if s.UID == "" || !slices.ContainsFunc(rb.OwnerReferences, func(r metav1.OwnerReference) bool {
		return r.UID == s.UID && r.Kind == "Secret" && r.APIVersion == "v1"
	}) {
		return ErrNotOwned
	}
	uid := rb.UID
	t0 = d.now()
	err = rbs.Delete(ctx, rb.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
	d.timed(ctx, "delete_rolebinding", t0, err)
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete RoleBinding %s/%s: %w", s.Namespace, s.Name, err)
	}
	return nil
}

// LogBindingError logs what became of a lease's RoleBinding that a
// revocation could not delete (Revoke's bindingErr); nil logs nothing.
func LogBindingError(log *zap.Logger, err error) {
	switch {
	case errors.Is(err, ErrNotOwned):
		log.Info("the RoleBinding of the lease's name is not the lease's; left alone")
	case err != nil:
		log.Warn("deleting the lease's RoleBinding failed; the garbage collector deletes it with the lease", zap.Error(err))
	}
}
