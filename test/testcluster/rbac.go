package testcluster

import (
	"context"
	"fmt"
	"strings"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// rbacPropagationTimeout bounds how long WaitAllowed waits: the
// authorizer's view of RBAC lags its writes by well under a second.
const rbacPropagationTimeout = 15 * time.Second

// WaitAllowed waits until the API server's authorizer allows user (in
// groups) every one of attrs, as a SubjectAccessReview asked with client
// says. The authorizer sees a new Role, binding or aggregated rule a
// moment after it is written; a test that uses an access it has just
// granted waits here first.
func WaitAllowed(ctx context.Context, client kubernetes.Interface, user string, groups []string, attrs ...authorizationv1.ResourceAttributes) error {
	for _, a := range attrs {
		var last string
		err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, rbacPropagationTimeout, true, func(ctx context.Context) (bool, error) {
			r, err := client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
				Spec: authorizationv1.SubjectAccessReviewSpec{User: user, Groups: groups, ResourceAttributes: &a},
			}, metav1.CreateOptions{})
			if err != nil {
				last = err.Error()
				return false, nil
			}
			last = r.Status.Reason
			return r.Status.Allowed, nil
		})
		if err != nil {
			return fmt.Errorf("%s is not allowed %+v after %s (%s): %w", user, a, rbacPropagationTimeout, last, err)
		}
	}
	return nil
}

// ServiceAccountUser returns the user name and groups that the API server
// gives namespace/name's tokens, for WaitAllowed.
func ServiceAccountUser(namespace, name string) (string, []string) {
	return "system:serviceaccount:" + namespace + ":" + name,
		[]string{"system:serviceaccounts", "system:serviceaccounts:" + namespace, "system:authenticated"}
}

// RuleAttributes is what a SubjectAccessReview asks to check that rule is
// in force in namespace: its first verb on its first resource (a
// "resource/subresource" split) and first name, if it names any.
func RuleAttributes(rule rbacv1.PolicyRule, namespace string) authorizationv1.ResourceAttributes {
	resource, sub, _ := strings.Cut(rule.Resources[0], "/")
	a := authorizationv1.ResourceAttributes{Namespace: namespace, Group: rule.APIGroups[0], Resource: resource, Subresource: sub, Verb: rule.Verbs[0]}
	if len(rule.ResourceNames) > 0 {
		a.Name = rule.ResourceNames[0]
	}
	return a
}
